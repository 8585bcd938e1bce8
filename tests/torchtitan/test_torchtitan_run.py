"""scripts/train.sh's config check: a config typo is one line before torchrun starts. (The run
log with its summary, a resume with changed settings and the switch of optimizers run on the
main job's checkpoint: test_torchtitan_e2e.py.)

Marked slow (the check imports torchtitan: about 10 s on 2 CPU cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "llama3_debug_muon.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux", reason="torchrun + gloo runs are exercised on Linux"
    ),
]


def train_sh(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """``train.sh CONFIG ARGS`` in one process."""
    env = dict(os.environ)
    env.update(
        PYTHON=sys.executable,
        NPROC="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf_cache"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("OMP_NUM_THREADS", None)
    cmd = ["bash", "scripts/train.sh", str(CONFIG), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_typo_fails_in_one_line_before_torchrun(tmp_path: Path) -> None:
    proc = train_sh(["--optimizer.muon.ns_stepz", "7"], tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "config error: optimizer.muon.ns_stepz: unknown key (command line "
        "--optimizer.muon.ns_stepz); did you mean optimizer.muon.ns_steps?"
    ]
