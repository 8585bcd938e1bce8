"""The environment for a test's Python subprocess: this checkout first on the import path."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` with the repository prepended to ``PYTHONPATH`` (packages the parent
    finds through it, such as a ``--target`` install, stay importable) and ``overrides``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **overrides}
