"""torchtune's shipped recipe modules, loaded from their files.

The torchtune wheel installs its recipes as files of a top-level ``recipes`` folder whose
``__init__.py`` raises on import (recipes are meant to be copied, not imported). Subclassing one
instead of copying it keeps every upstream feature and fix: this loads a recipe file as a
private module without running ``recipes/__init__.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_recipe_module", "recipes_dir"]


def recipes_dir() -> Path:
    """The folder of torchtune's shipped recipes: ``recipes/`` beside the ``torchtune`` package,
    where ``tune run <recipe name>`` finds them too."""
    spec = importlib.util.find_spec("torchtune")
    if spec is not None and spec.origin:
        folder = Path(spec.origin).parent.parent / "recipes"
        if (folder / "full_finetune_distributed.py").is_file():
            return folder
    raise ModuleNotFoundError(
        "torchtune's recipes folder (recipes/full_finetune_distributed.py beside the torchtune "
        "package, shipped in its wheel) was not found: install torchtune==0.6.1 "
        "(scripts/setup_env.sh --torchtune)"
    )


def load_recipe_module(name: str) -> ModuleType:
    """The shipped recipe ``name`` (e.g. ``"full_finetune_distributed"``) as a module."""
    module_name = f"muon_plugin.torchtune._upstream_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = recipes_dir() / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ModuleNotFoundError(f"torchtune recipe file not found: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
