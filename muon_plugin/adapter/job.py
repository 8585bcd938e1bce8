"""One job's Muon optimizers: built from the options and the class rules, with their table,
plan report and build log.

Every front end reduces its configuration to a
:class:`~muon_plugin.param_groups.builder.BaseHyperparams` (the job's own lr / weight decay /
Adam betas / eps / fused flag) and a :class:`~muon_plugin.param_groups.options.MuonConfig`,
then calls :func:`build_job_optimizers`: one optimizer per model part holding all the param
groups (Muon and AdamW), so that checkpointing and LR schedulers see a single optimizer per
part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer

from muon_plugin.param_groups.builder import BaseHyperparams, optimizer_setup, with_config_key
from muon_plugin.param_groups.groups import build_param_groups
from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.param_groups.rules import RuleSet, check_unused_patterns
from muon_plugin.param_groups.rules_table import format_rules_table
from muon_plugin.qk_clip import QKClip

__all__ = [
    "JobOptimizers",
    "NamedParameters",
    "build_job_optimizers",
    "is_rank0",
    "log_plan_after_first_step",
]

logger = logging.getLogger(__name__)

NamedParameters = Sequence[tuple[str, Tensor]]
"""One model part's ``(name, parameter)`` pairs."""


def is_rank0() -> bool:
    """Whether this process logs (rank 0, or no process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


@dataclass
class JobOptimizers:
    """What :func:`build_job_optimizers` returns: the optimizers and how they were built."""

    optimizers: list[Optimizer]
    """One optimizer per model part."""
    group_classes: list[list[str]]
    """Per model part, the class of each param group."""
    params: list[Tensor]
    """Every trainable parameter, over all parts."""
    optimizer_cls: type[Optimizer]
    kwargs: dict[str, Any]
    """The constructor arguments shared by all parts."""
    rules: RuleSet
    config: MuonConfig
    """The options in force."""
    qk_clip: QKClip | None = None
    """The job's QK-Clip (:mod:`muon_plugin.adapter.qk_clip`), None when it is off."""
    _changes_on_load: dict[int, list[str]] = field(default_factory=dict, repr=False)

    @property
    def changes_on_load(self) -> list[str]:
        """The group settings the last checkpoint load of each part replaced by the job's
        (see :func:`muon_plugin.adapter.resume.keep_job_settings_on_load`)."""
        return [c for part in sorted(self._changes_on_load) for c in self._changes_on_load[part]]

    def set_changes_on_load(self, part: int, changes: list[str]) -> None:
        """Record what the last load of model part ``part`` changed."""
        self._changes_on_load[part] = changes

    def format_rules(self) -> str:
        """The param-group table(s), one per model part."""
        parts = []
        for i, (opt, classes) in enumerate(zip(self.optimizers, self.group_classes, strict=True)):
            title = f"model part {i}:\n" if len(self.optimizers) > 1 else ""
            parts.append(title + format_rules_table(opt.param_groups, classes))
        return "\n".join(parts)

    def format_plan_report(self) -> str | None:
        """The optimizers' distributed orthogonalization plans, if they report one."""
        reports = []
        for i, opt in enumerate(self.optimizers):
            fmt = getattr(opt, "format_plan_report", None)
            text = fmt() if fmt is not None else None
            if text:
                title = f"model part {i}:\n" if len(self.optimizers) > 1 else ""
                reports.append(title + text)
        return "\n".join(reports) if reports else None

    def format_build_summary(self) -> str:
        """The rank-0 build log: the optimizer's settings and the param-group table."""
        cfg, kw = self.config, self.kwargs
        return (
            f"Muon optimizer: {self.optimizer_cls.__name__}, {cfg.orthogonalization} "
            f"x{cfg.ns_steps}, momentum {cfg.momentum}"
            f"{' (nesterov)' if cfg.nesterov else ''}, lr_adjust {cfg.lr_adjust}, "
            f"cautious wd {cfg.cautious_weight_decay}, adam betas {kw['adam_betas']} "
            f"eps {kw['adam_eps']}, fused adam {kw['fused_adam']}, "
            f"state dtype {cfg.state_dtype}, skip non-finite {cfg.skip_nonfinite}"
            f"{format_qk_clip_settings(cfg)}\n"
            "Muon param groups:\n"
            f"{self.format_rules()}"
        )

    def skipped_updates(self) -> int:
        """Muon matrix updates skipped (non-finite direction) so far, on this rank."""
        return sum(int(getattr(opt, "skipped_updates", 0)) for opt in self.optimizers)

    def log_build(
        self,
        register_step_post_hook: Callable[[Callable[..., None]], Any],
        log: logging.Logger | None = None,
    ) -> None:
        """With ``log_plan``: the build summary now (rank 0), the plan after the first step.

        ``register_step_post_hook``: where the framework steps (a container's or the
        optimizer's own ``register_step_post_hook``).
        """
        if not self.config.log_plan:
            return
        log = log or logger
        if is_rank0():
            log.info(self.format_build_summary())
        log_plan_after_first_step(register_step_post_hook, self.format_plan_report, log)


def format_qk_clip_settings(cfg: MuonConfig) -> str:
    """The QK-Clip settings as the build summary shows them (nothing when it is off)."""
    if cfg.qk_clip_tau is None:
        return ""
    return f", qk-clip tau {cfg.qk_clip_tau:g} alpha {cfg.qk_clip_alpha:g} gqa {cfg.qk_clip_gqa}"


def build_job_optimizers(
    parts: Sequence[nn.Module | NamedParameters],
    cfg: MuonConfig,
    base: BaseHyperparams,
    option_prefix: str = "optimizer.muon.",
) -> JobOptimizers:
    """One optimizer per model part with the param groups the options' rules give.

    ``parts``: modules, or each part's ``(name, parameter)`` pairs; ``option_prefix``: how the
    front end writes the options' names in errors. Only parameters that
    require grad are optimized. Every group carries ``param_names`` (wrapper-free FQNs), which
    FQN-keyed checkpoints need. Raises ValueError (or TypeError) naming the
    ``optimizer.muon.*`` key of an invalid option or of a pattern that matches no parameter in
    any part.
    """
    cfg.validate()
    rules = cfg.rules(option_prefix)
    optimizer_cls, kwargs = optimizer_setup(cfg, base)
    optimizers: list[Optimizer] = []
    group_classes: list[list[str]] = []
    all_params: list[Tensor] = []
    used: set[tuple[str, str]] = set()
    for part in parts:
        pairs = part.named_parameters() if isinstance(part, nn.Module) else part
        named = [(n, p) for n, p in pairs if p.requires_grad]
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
    return JobOptimizers(optimizers, group_classes, all_params, optimizer_cls, kwargs, rules, cfg)


def log_plan_after_first_step(
    register_step_post_hook: Callable[[Callable[..., None]], Any],
    report: Callable[[], str | None],
    log: logging.Logger | None = None,
) -> None:
    """Log (rank 0) ``report()`` once, after the first optimizer step."""
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


class JobContainerMixin:
    """What a framework's optimizer container (one optimizer per model part) shows of its
    :class:`JobOptimizers`: ``optimizers``, ``group_classes``, ``rules``, ``job``, the table,
    the plan report and the changes of the last checkpoint load."""

    job: JobOptimizers
    optimizers: list[Optimizer]
    group_classes: list[list[str]]
    rules: RuleSet

    def _attach_job(self, job: JobOptimizers) -> None:
        """Show ``job``'s optimizers as this container's."""
        self.job = job
        self.optimizers = job.optimizers
        self.group_classes = job.group_classes
        self.rules = job.rules

    @property
    def muon_config(self) -> MuonConfig:
        """The Muon options in force."""
        return self.job.config

    @property
    def changes_on_load(self) -> list[str]:
        """The group settings the last checkpoint load replaced by the job's, as logged."""
        return self.job.changes_on_load

    def format_rules(self) -> str:
        """The param-group table(s), one per model part."""
        return self.job.format_rules()

    def format_plan_report(self) -> str | None:
        """The optimizers' distributed orthogonalization plans, if they report one."""
        return self.job.format_plan_report()
