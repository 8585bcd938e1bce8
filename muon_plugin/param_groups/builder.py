"""The release-independent builder core: model parts + options -> param groups -> optimizers.

Every front end (each torchtitan release's adapter, plain PyTorch) reduces its configuration to
a :class:`BaseHyperparams` (the job's own lr / weight decay / Adam betas / eps / fused flag) and
a :class:`~muon_plugin.param_groups.options.MuonConfig`, then calls :func:`build_part_optimizers`:
one Muon optimizer per model part holding all the param groups (Muon and AdamW), so that
checkpointing and LR schedulers see a single optimizer per part. :func:`format_build_summary`
is the rank-0 log line with the rule table, :func:`format_plan_report` the distributed
orthogonalization plan. Nothing here imports torchtitan.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.param_groups.rules import RuleSet, build_param_groups, check_unused_patterns
from muon_plugin.param_groups.rules_table import format_rules_table

__all__ = [
    "BaseHyperparams",
    "PartOptimizers",
    "build_part_optimizers",
    "format_build_summary",
    "format_plan_report",
    "format_rules",
    "is_rank0",
    "log_plan_after_first_step",
    "low_precision_kwargs",
    "optimizer_kwargs",
    "resolve_optimizer_cls",
]

logger = logging.getLogger(__name__)


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


def is_rank0() -> bool:
    """Whether this process logs (rank 0, or no process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


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


@dataclass
class PartOptimizers:
    """What :func:`build_part_optimizers` returns."""

    optimizers: list[Optimizer]
    """One optimizer per model part."""
    group_classes: list[list[str]]
    """Per model part, the class of each param group."""
    params: list[nn.Parameter]
    """Every trainable parameter, over all parts."""
    optimizer_cls: type[Optimizer]
    kwargs: dict[str, Any]
    """The constructor arguments shared by all parts."""
    rules: RuleSet


def optimizer_setup(cfg: MuonConfig, base: BaseHyperparams) -> tuple[type[Optimizer], dict]:
    """The optimizer class and the constructor arguments the options and the job give."""
    kwargs = optimizer_kwargs(base, cfg)
    kwargs.update(low_precision_kwargs(cfg))
    return resolve_optimizer_cls(cfg), kwargs


def build_part_optimizers(
    model_parts: Sequence[nn.Module], cfg: MuonConfig, base: BaseHyperparams
) -> PartOptimizers:
    """One optimizer per model part with the param groups the options' rules give.

    Every group carries ``param_names`` (wrapper-free FQNs), which FQN-keyed checkpoints need.
    Raises ValueError naming the ``optimizer.muon.*`` key of an invalid option or of a
    pattern that matches no parameter in any part.
    """
    cfg.validate()
    rules = cfg.rules()
    optimizer_cls, kwargs = optimizer_setup(cfg, base)
    optimizers: list[Optimizer] = []
    group_classes: list[list[str]] = []
    all_params: list[nn.Parameter] = []
    used: set[tuple[str, str]] = set()
    for model in model_parts:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups, classes = build_param_groups(
            named, rules, lr=kwargs["lr"], weight_decay=kwargs["wd"], used_patterns=used
        )
        try:
            optimizers.append(optimizer_cls(groups, **kwargs))
        except (ValueError, TypeError) as e:
            raise with_config_key(e) from e
        group_classes.append(classes)
        all_params.extend(p for _, p in named)
    check_unused_patterns(rules, used)
    return PartOptimizers(optimizers, group_classes, all_params, optimizer_cls, kwargs, rules)


def format_rules(optimizers: Sequence[Optimizer], group_classes: Sequence[Sequence[str]]) -> str:
    """The param-group table(s), one per model part."""
    parts = []
    for i, (opt, classes) in enumerate(zip(optimizers, group_classes, strict=True)):
        title = f"model part {i}:\n" if len(optimizers) > 1 else ""
        parts.append(title + format_rules_table(opt.param_groups, classes))
    return "\n".join(parts)


def format_plan_report(optimizers: Sequence[Optimizer]) -> str | None:
    """The optimizers' distributed orthogonalization plans, if they report one."""
    reports = []
    for i, opt in enumerate(optimizers):
        fmt = getattr(opt, "format_plan_report", None)
        if fmt is None:
            continue
        text = fmt()
        if text:
            title = f"model part {i}:\n" if len(optimizers) > 1 else ""
            reports.append(title + text)
    return "\n".join(reports) if reports else None


def format_build_summary(built: PartOptimizers, cfg: MuonConfig) -> str:
    """The rank-0 build log: the optimizer's settings and the param-group table."""
    kw = built.kwargs
    return (
        f"Muon optimizer: {built.optimizer_cls.__name__}, {cfg.orthogonalization} "
        f"x{cfg.ns_steps}, momentum {cfg.momentum}"
        f"{' (nesterov)' if cfg.nesterov else ''}, lr_adjust {cfg.lr_adjust}, "
        f"cautious wd {cfg.cautious_weight_decay}, adam betas {kw['adam_betas']} "
        f"eps {kw['adam_eps']}, fused adam {kw['fused_adam']}, "
        f"state dtype {cfg.state_dtype}, skip non-finite {cfg.skip_nonfinite}\n"
        "Muon param groups:\n"
        f"{format_rules(built.optimizers, built.group_classes)}"
    )


def log_build(
    built: PartOptimizers,
    cfg: MuonConfig,
    register_step_post_hook: Callable[[Callable[..., None]], Any],
    report: Callable[[], str | None],
    log: logging.Logger | None = None,
) -> None:
    """With ``log_plan``: the build summary now (rank 0), the plan after the first step."""
    if not cfg.log_plan:
        return
    log = log or logger
    if is_rank0():
        log.info(format_build_summary(built, cfg))
    log_plan_after_first_step(register_step_post_hook, report, log)


def log_plan_after_first_step(
    register_step_post_hook: Callable[[Callable[..., None]], Any],
    report: Callable[[], str | None],
    log: logging.Logger | None = None,
) -> None:
    """Log (rank 0) ``report()`` once, after the first optimizer step.

    ``register_step_post_hook``: the container's ``Optimizer.register_step_post_hook``.
    """
    log = log or logger
    done = False

    def hook(*args: Any, **kwargs: Any) -> None:
        # Not removed from inside the hook: torch iterates the hook dict while calling it.
        nonlocal done
        if done:
            return
        done = True
        if not is_rank0():
            return
        try:
            text = report()
        except Exception as e:  # a report must never stop training
            log.warning(f"Muon: could not format the orthogonalization plan: {e!r}")
            return
        if text:
            log.info(
                text
                if text.lstrip().lower().startswith("muon")
                else f"Muon orthogonalization plan:\n{text}"
            )

    register_step_post_hook(hook)
