"""The training corpus built in torchtitan 0.3's environment is the one the 0.2.2 environment
builds: scripts/prepare_data.py reads torchtitan 0.2.2's sources from the wheel that
``scripts/setup_env.sh --titan03`` keeps, so loss curves compare across releases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"


def _build(python: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, str(SCRIPT), "--out", str(out), "-q", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip


def test_both_environments_build_the_same_corpus(tmp_path: Path) -> None:
    py022 = os.environ.get("MUON_PLUGIN_PYTHON_022") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(py022).exists():
        pytest.skip("no torchtitan 0.2.2 environment (./.venv or MUON_PLUGIN_PYTHON_022)")
    hashes = {}
    for release, py in (("0.3", sys.executable), ("0.2.2", py022)):
        proc = _build(py, tmp_path / release)
        assert proc.returncode == 0, (release, proc.stdout + proc.stderr)
        manifest = json.loads((tmp_path / release / "manifest.json").read_text())
        assert manifest["key"]["packages"] == {"torch": "2.13.0", "torchtitan": "0.2.2"}
        hashes[release] = manifest["corpus_sha256"]
    assert hashes["0.3"] == hashes["0.2.2"]
    # Either environment then finds the other's data up to date.
    again = _build(sys.executable, tmp_path / "0.2.2")
    assert again.returncode == 0 and "is up to date" in again.stdout


def test_without_the_pinned_wheel_the_error_names_the_pin_and_the_way_out(tmp_path) -> None:
    proc = _build(sys.executable, tmp_path / "data", "--wheels", str(tmp_path / "none"))
    assert proc.returncode == 1
    assert "the corpus is defined by torchtitan==0.2.2, found torchtitan 0.3.0" in proc.stderr
    assert "--any-version" in proc.stderr and not (tmp_path / "data").exists()
