"""The environment for a test's Python subprocess: this checkout first on the import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` with the repository prepended to ``PYTHONPATH`` (packages the parent
    finds through it, such as a ``--target`` install, stay importable) and ``overrides``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **overrides}


def run_in_interpreter(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``tests/<script>`` in a Python subprocess under the Triton interpreter
    (``TRITON_INTERPRET=1``, set before triton is imported; Triton not switched off)."""
    env = python_env(TRITON_INTERPRET="1")
    env.pop("MUON_PLUGIN_DISABLE_TRITON", None)
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
