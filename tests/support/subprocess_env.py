"""The environment for a test's Python subprocess: this checkout first on the import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"


def python_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` with the repository prepended to ``PYTHONPATH`` (packages the parent
    finds through it, such as a ``--target`` install, stay importable) and ``overrides``."""
    path = os.pathsep.join(
        p for p in (str(REPO), str(SUPPORT), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, "PYTHONPATH": path, **overrides}


def run_test_script(script: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run the module ``tests/support/<script>`` in a fresh Python subprocess, from the
    repository root, with ``env`` added (Triton not switched off)."""
    full_env = python_env(**env)
    full_env.pop("MUON_PLUGIN_DISABLE_TRITON", None)
    return subprocess.run(
        [sys.executable, str(SUPPORT / script)],
        env=full_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Triton 3.6's interpreter turns a loop bound taken from a run-time argument into a 1-element
# array and calls int() on it, which numpy 2.4 rejects.
_NUMPY_SCALAR_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def run_in_interpreter(script: str) -> subprocess.CompletedProcess:
    """:func:`run_test_script` under the Triton interpreter (``TRITON_INTERPRET=1``, set
    before triton is imported). A Triton whose interpreter cannot run our kernels' loops under
    this numpy skips the test (the kernels compile and run on a GPU all the same)."""
    proc = run_test_script(script, TRITON_INTERPRET="1")
    if proc.returncode and _NUMPY_SCALAR_BUG in proc.stderr:
        pytest.skip(
            "this Triton's interpreter cannot run a loop bound from a run-time argument under "
            "numpy >= 2.4 (seen with triton 3.6 on numpy 2.4 and 2.5; fixed by triton 3.9)"
        )
    return proc
