"""Options -> the optimizer's class and constructor arguments, and errors named by job key.

Every front end reduces its configuration to a :class:`BaseHyperparams` (the job's own lr /
weight decay / Adam betas / eps / fused flag) and a
:class:`~muon_plugin.param_groups.options.MuonConfig`; :func:`optimizer_setup` turns the two into
the optimizer class and its constructor arguments (the adapter core,
:mod:`muon_plugin.adapter.job`, builds the optimizers). Nothing here imports torchtitan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

from muon_plugin.errors import SettingError
from muon_plugin.param_groups.options import MuonConfig

__all__ = [
    "OPTION_CORE_KEYS",
    "TORCHTITAN_KEYS",
    "BaseHyperparams",
    "KeySpelling",
    "core_keys",
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


@dataclass(frozen=True)
class KeySpelling:
    """How a front end spells the settings it reads, for errors: by the error's key and kind
    (:class:`~muon_plugin.errors.SettingError`), never by its text."""

    options: str
    """The section of the ``[optimizer.muon]`` options: ``"optimizer.muon"``."""
    core: Mapping[str, str]
    """Optimizer arguments / group keys -> the job keys they come from."""
    job: Mapping[str, str] = field(default_factory=dict)
    """The front end's own optimizer fields that it spells otherwise than ``section.field``."""

    def spell(self, error: Exception) -> Exception:
        """``error`` with its setting spelled this front end's way (an error that names no
        setting gets the options' section in front)."""
        if not isinstance(error, SettingError):
            return type(error)(f"{self.options}: {error}")
        if error.kind == "core":
            return error.spelled(self.core.get(error.key, self.options))
        if error.kind == "option":
            return error.spelled(f"{self.options}.{error.key}")
        return error.spelled(self.job.get(error.key, error.where))


def core_keys(options: str, job: str, beta: str, eps: str) -> dict[str, str]:
    """The optimizer's keys spelled as a front end with options section ``options`` and job
    section ``job`` names their sources (``beta``, ``eps``: its names for the Adam betas and
    eps)."""
    own = {key: f"{options}.{key}" for key in OPTION_CORE_KEYS}
    return {
        **own,
        "lr": f"{job}.lr (or {options}.<class>_lr)",
        "wd": f"{job}.weight_decay (or {options}.<class>_weight_decay)",
        "adam_eps": f"{eps} (or {options}.adam_eps)",
        "adam_betas": f"{beta} (or {options}.adam_beta1 / adam_beta2)",
        "steps": f"{options}.ns_steps",
        "orthogonalization_strategy": f"{options}.orthogonalization",
        "strategy": f"{options}.orthogonalization",
        "normalization": f"{options}.normalization (or {options}.<class>_normalization)",
        "algorithm": f"{options}.<class>_algorithm",
    }


OPTION_CORE_KEYS = (
    "momentum", "ns_steps", "lr_adjust", "state_dtype", "block_size", "skip_nonfinite",
    "flatten", "backend", "normuon_beta2", "normuon_eps", "normuon_rescale",
)  # fmt: skip
"""Optimizer arguments that are options of the same name."""

TORCHTITAN_KEYS = KeySpelling(
    options="optimizer.muon",
    core=core_keys(
        "optimizer.muon", "optimizer", "optimizer.beta1 / optimizer.beta2", "optimizer.eps"
    ),
)
"""torchtitan's spelling (both releases): ``[optimizer]`` and ``[optimizer.muon]``."""


def with_config_key(error: Exception) -> Exception:
    """``error`` (raised by the optimizer core or the options) spelled as torchtitan's job
    keys (:data:`TORCHTITAN_KEYS`)."""
    return TORCHTITAN_KEYS.spell(error)


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
