"""Fixtures shared by the test modules that run real training jobs; the heartbeat plugin
(``tests/heartbeat.py``: a line a minute while a long test runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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
