"""The environment for a test's Python subprocess: this checkout first on the import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"


def python_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` with the repository prepended to ``PYTHONPATH`` (packages the parent
    finds through it, such as a ``--target`` install, stay importable) and ``overrides``."""
    path = os.pathsep.join(
        p for p in (str(REPO), str(HELPERS), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, "PYTHONPATH": path, **overrides}


def run_test_script(script: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run the helper module ``tests/helpers/<script>`` in a fresh Python subprocess, from the
    repository root, with ``env`` added (Triton not switched off)."""
    full_env = python_env(**env)
    full_env.pop("MUON_PLUGIN_DISABLE_TRITON", None)
    return subprocess.run(
        [sys.executable, str(HELPERS / script)],
        env=full_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_in_interpreter(script: str) -> subprocess.CompletedProcess:
    """:func:`run_test_script` under the Triton interpreter (``TRITON_INTERPRET=1``, set
    before triton is imported)."""
    return run_test_script(script, TRITON_INTERPRET="1")
