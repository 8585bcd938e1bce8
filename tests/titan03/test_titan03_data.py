"""The training corpus in torchtitan 0.3's environment: built from that environment's pinned
packages (torch 2.14.1, torchtitan 0.3.0) the same way every time, and a ``data/`` built by the
torchtitan 0.2.2 environment is kept rather than rebuilt (the two share one folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"


def _build(python: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, str(SCRIPT), "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_the_corpus_of_this_environment_is_reproducible(tmp_path: Path) -> None:
    first, second = _build(sys.executable, tmp_path / "a"), _build(sys.executable, tmp_path / "b")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    manifest = _manifest(tmp_path / "a")
    assert manifest["key"]["packages"] == {"torch": "2.14.1", "torchtitan": "0.3.0"}
    assert manifest["corpus_sha256"] == _manifest(tmp_path / "b")["corpus_sha256"]
    assert manifest["tokens"]["train_estimated"] >= 8_000_000
    assert f"corpus sha256 {manifest['corpus_sha256'][:16]}" in first.stdout


def test_data_built_by_the_other_environment_is_kept(tmp_path: Path) -> None:
    py022 = os.environ.get("MUON_PLUGIN_PYTHON_022") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(py022).exists():
        pytest.skip("no torchtitan 0.2.2 environment (./.venv or MUON_PLUGIN_PYTHON_022)")
    out = tmp_path / "data"
    assert _build(py022, out).returncode == 0
    before = _manifest(out)
    again = _build(sys.executable, out)
    assert again.returncode == 0, again.stderr
    assert (
        "is up to date" in again.stdout and "(from torch 2.13.0, torchtitan 0.2.2)" in again.stdout
    )
    assert _manifest(out) == before
