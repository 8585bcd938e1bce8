"""Options -> the optimizer's class and constructor arguments, and errors named by job key.

Every front end reduces its configuration to a :class:`BaseHyperparams` (the job's own lr /
weight decay / Adam betas / eps / fused flag) and a
:class:`~muon_plugin.param_groups.options.MuonConfig`; :func:`optimizer_setup` turns the two into
the optimizer class and its constructor arguments (the adapter core,
:mod:`muon_plugin.adapter.job`, builds the optimizers). Nothing here imports torchtitan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer

from muon_plugin.param_groups.options import MuonConfig

__all__ = [
    "CONFIG_KEYS",
    "BaseHyperparams",
    "low_precision_kwargs",
    "optimizer_kwargs",
    "optimizer_setup",
    "resolve_optimizer_cls",
    "with_config_key",
]


@dataclass(frozen=True)
class BaseHyperparams:
    """The job's own optimizer settings, the defaults every parameter class starts from."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    fused: bool = True
    """Use the fused Adam kernel for the Adam(W) groups."""


def resolve_optimizer_cls(cfg: MuonConfig) -> type[Optimizer]:
    """The optimizer class the options select (``state_dtype`` != fp32: MuonLP)."""
    from muon_plugin import Muon, MuonForeach, MuonLP

    if cfg.state_dtype != "fp32":
        return MuonLP  # raises an ImportError naming the `lp` extra if torchao is missing
    return MuonForeach if cfg.implementation == "foreach" else Muon


def optimizer_kwargs(base: BaseHyperparams, cfg: MuonConfig) -> dict[str, Any]:
    """Constructor arguments (the defaults of every group) from the job's settings + options."""
    beta1 = base.beta1 if cfg.adam_beta1 is None else cfg.adam_beta1
    beta2 = base.beta2 if cfg.adam_beta2 is None else cfg.adam_beta2
    eps = base.eps if cfg.adam_eps is None else cfg.adam_eps
    return {
        "lr": base.lr,
        "wd": base.weight_decay,
        "use_cautious_wd": cfg.cautious_weight_decay,
        "momentum": cfg.momentum,
        "nesterov": cfg.nesterov,
        "ns_steps": cfg.ns_steps,
        "orthogonalization_strategy": cfg.orthogonalization,
        "adam_betas": (beta1, beta2),
        "adam_eps": eps,
        "fused_adam": base.fused,
        "compile": cfg.compile,
        "backend": cfg.backend,
        "lr_adjust": cfg.lr_adjust,
        "flatten": cfg.flatten,
        "normalization": cfg.normalization,
        "normuon_beta2": cfg.normuon_beta2,
        "normuon_eps": cfg.normuon_eps,
        "normuon_rescale": cfg.normuon_rescale,
        **({"skip_nonfinite": True} if cfg.skip_nonfinite else {}),
    }


# Constructor / group keys of the optimizer core -> the job keys they come from.
CONFIG_KEYS: dict[str, str] = {
    "lr": "optimizer.lr (or optimizer.muon.<class>_lr)",
    "wd": "optimizer.weight_decay (or optimizer.muon.<class>_weight_decay)",
    "adam_eps": "optimizer.eps (or optimizer.muon.adam_eps)",
    "adam_betas": "optimizer.beta1 / optimizer.beta2 (or optimizer.muon.adam_beta1 / adam_beta2)",
    "momentum": "optimizer.muon.momentum",
    "ns_steps": "optimizer.muon.ns_steps",
    "steps": "optimizer.muon.ns_steps",
    "orthogonalization_strategy": "optimizer.muon.orthogonalization",
    "strategy": "optimizer.muon.orthogonalization",
    "lr_adjust": "optimizer.muon.lr_adjust",
    "state_dtype": "optimizer.muon.state_dtype",
    "block_size": "optimizer.muon.block_size",
    "skip_nonfinite": "optimizer.muon.skip_nonfinite",
    "flatten": "optimizer.muon.flatten",
    "backend": "optimizer.muon.backend",
    "normuon_beta2": "optimizer.muon.normuon_beta2",
    "normuon_eps": "optimizer.muon.normuon_eps",
    "normuon_rescale": "optimizer.muon.normuon_rescale",
    "normalization": "optimizer.muon.normalization (or optimizer.muon.<class>_normalization)",
    "algorithm": "optimizer.muon.<class>_algorithm",
}


def with_config_key(error: Exception) -> Exception:
    """``error`` (raised by the optimizer core) with the job key it comes from in front."""
    message = str(error)
    for name, key in CONFIG_KEYS.items():
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message):
            return type(error)(f"{key}: {message}")
    return type(error)(f"optimizer.muon: {message}")


def low_precision_kwargs(cfg: MuonConfig) -> dict[str, Any]:
    """MuonLP's extra arguments (none for fp32 state)."""
    if cfg.state_dtype == "fp32":
        return {}
    kwargs: dict[str, Any] = {"state_dtype": cfg.state_dtype}
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    return kwargs


def optimizer_setup(cfg: MuonConfig, base: BaseHyperparams) -> tuple[type[Optimizer], dict]:
    """The optimizer class and the constructor arguments the options and the job give."""
    kwargs = optimizer_kwargs(base, cfg)
    kwargs.update(low_precision_kwargs(cfg))
    return resolve_optimizer_cls(cfg), kwargs
