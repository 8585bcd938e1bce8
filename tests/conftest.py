"""The test tree: one folder per part of the package (``optimizer/``, ``orthogonalize/``,
``kernels/``, ``distributed/``, ``lp/``, ``param_groups/``, ``qk_clip/``, ``torchtitan/``,
``titan03/``, ``torchtune/``), the scripts' smoke tests (``scripts/``), the project's own rules
(``project/``), torch's and torchtitan's own suites (``*_upstream/``) and the modules the tests
share (``support/``, importable from every test). Also: the fixtures of the tests that run real
training jobs, and the heartbeat plugin (``support/heartbeat.py``: a line a minute while a long
test runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))  # "from dist_utils import ...", in every test folder

pytest_plugins = ["heartbeat"]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """Corpus + tokenizer from scripts/prepare_data.py (this environment's), in a temporary
    folder: built once per test session."""
    out = tmp_path_factory.mktemp("data")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--out", str(out), "-q"],
        check=True,
        cwd=ROOT,
        timeout=300,
    )
    return out
