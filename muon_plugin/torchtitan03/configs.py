"""torchtitan 0.3 configs with Muon: ``--module muon_plugin.torchtitan03.configs --config NAME``.

``NAME`` is ``<model>.<config function>`` of any config torchtitan ships (``llama3.llama3_8b``,
``deepseek_v3.deepseek_v3_debugmodel``): that config with its optimizer swapped for
:class:`~muon_plugin.torchtitan03.container.MuonOptimizersContainer.Config` (as the
``override.muon`` override does). Unlike the override, every Muon option is then a CLI flag
(``--optimizer.muon.ns_steps 7``, ``--optimizer.muon_toml FILE``) listed by ``--help``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__: list[str] = []


def shipped(model: str, function: str) -> Any:
    """torchtitan's ``<model>.config_registry.<function>()`` with Muon as its optimizer."""
    from muon_plugin.torchtitan03.override import to_muon

    try:
        registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    except ModuleNotFoundError:
        msg = f"--config {model}.{function}: torchtitan has no model {model!r}"
        raise ValueError(msg) from None
    fn = getattr(registry, function, None)
    if not callable(fn):
        raise ValueError(f"--config {model}.{function}: {registry.__name__} has no {function!r}")
    config = fn()
    config.optimizer = to_muon(config.optimizer)
    return config


def __getattr__(name: str) -> Callable[[], Any]:
    model, sep, function = name.partition(".")
    if not sep or not model.isidentifier() or not function.isidentifier():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return lambda: shipped(model, function)
