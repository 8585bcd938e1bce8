"""Tests of the torchtitan 0.3 adapter: collected only where torchtitan 0.3 is installed
(the second environment, ``.venv-titan03``; ``scripts/test.sh`` runs them there)."""

import importlib.util


def _torchtitan03() -> bool:
    try:
        return importlib.util.find_spec("torchtitan.config.override") is not None
    except ModuleNotFoundError:
        return False


collect_ignore_glob = [] if _torchtitan03() else ["test_*.py"]
