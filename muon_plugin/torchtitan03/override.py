"""``--override.imports muon_plugin.torchtitan03.override.muon``: Muon for any torchtitan 0.3
config, without editing Python.

The override replaces the config's ``OptimizersContainer.Config`` by
:class:`~muon_plugin.torchtitan03.container.MuonOptimizersContainer.Config`, taking ``lr``,
``weight_decay``, ``betas`` and ``eps`` from the config's catch-all Adam(W) param group (the one
whose pattern matches every name, as ``default_adamw`` builds it; else the last group). Muon
options come as the override's JSON kwargs (any ``optimizer.muon`` option, plus ``muon_toml``,
``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``)::

    --override.imports 'muon_plugin.torchtitan03.override.muon={"ns_steps": 7, "lr": 0.01}'

Importing this module registers the override with torchtitan's override registry (inert until
an ``override.imports`` entry names it); it changes nothing else.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive, override

from muon_plugin.param_groups.messages import did_you_mean
from muon_plugin.param_groups.options import MUON_CONFIG_KEYS
from muon_plugin.torchtitan03.container import MuonOptimizersContainer

__all__ = ["muon", "to_muon"]

_BASE_KEYS = ("lr", "weight_decay", "beta1", "beta2", "eps", "muon_toml")


def _base_from_groups(cfg: OptimizersContainer.Config) -> dict[str, Any]:
    groups = list(cfg.param_groups)
    if not groups:
        return {}
    catch_all = [g for g in groups if re.fullmatch(g.pattern, "") or g.pattern in (".*", "")]
    group = catch_all[0] if catch_all else groups[-1]
    if group.optimizer_name not in ("Adam", "AdamW"):
        raise ValueError(
            f"override muon_plugin.torchtitan03.override.muon: optimizer.param_groups pattern "
            f"{group.pattern!r} uses {group.optimizer_name!r}; its lr / weight decay cannot be "
            'taken over (pass them as override kwargs, e.g. {"lr": 0.01})'
        )
    kw = group.optimizer_kwargs
    base: dict[str, Any] = {}
    if "lr" in kw:
        base["lr"] = float(kw["lr"])
    if "weight_decay" in kw:
        base["weight_decay"] = float(kw["weight_decay"])
    if "betas" in kw:
        base["beta1"], base["beta2"] = (float(b) for b in kw["betas"])
    if "eps" in kw:
        base["eps"] = float(kw["eps"])
    return base


def to_muon(cfg: OptimizersContainer.Config, **options: Any) -> MuonOptimizersContainer.Config:
    """``cfg`` as a Muon config; ``options``: Muon options and the container's own fields."""
    unknown = sorted(set(options) - set(MUON_CONFIG_KEYS) - set(_BASE_KEYS))
    if unknown:
        valid = _BASE_KEYS + MUON_CONFIG_KEYS
        hint = did_you_mean(unknown[0], valid) or f" (valid: {', '.join(valid)})"
        raise ValueError(
            f"override muon_plugin.torchtitan03.override.muon: unknown option {unknown[0]!r}{hint}"
        )
    base = {k: v for k, v in options.items() if k in _BASE_KEYS}
    muon_options = {k: v for k, v in options.items() if k in MUON_CONFIG_KEYS}
    if isinstance(cfg, MuonOptimizersContainer.Config):
        result = dataclasses.replace(cfg, **base)
    else:
        result = derive(
            cfg,
            MuonOptimizersContainer.Config,
            param_groups=[],
            optimizer_factory_kwargs_by_name={},
            **{**_base_from_groups(cfg), **base},
        )
    if muon_options:
        result.muon = dataclasses.replace(result.muon, **muon_options)
    return result


@override(
    target=OptimizersContainer.Config,
    description="muon_plugin: Muon on matrices, AdamW on the rest (one optimizer per part)",
)
def muon(cfg: OptimizersContainer.Config, **options: Any) -> MuonOptimizersContainer.Config:
    """The override: :func:`to_muon`."""
    return to_muon(cfg, **options)
