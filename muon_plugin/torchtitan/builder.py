"""Build the Muon optimizer for torchtitan's ``Trainer``: one optimizer per model part.

``build_muon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None)`` has the
signature of torchtitan's ``build_optimizers`` and returns a :class:`MuonOptimizersContainer`,
a subclass of torchtitan's ``OptimizersContainer`` whose single optimizer per model part holds
all the param groups (Muon and AdamW): torchtitan's checkpointing (``state_dict`` /
``load_state_dict`` with ``flatten_optimizer_state_dict``), LR schedulers (one ``LambdaLR`` per
inner optimizer, scaling each group's own ``initial_lr``), gradient clipping, the MoE
load-balancing pre-step hook and float8 post-step hooks all work unchanged.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.param_groups.rules import (
    RuleSet,
    build_param_groups,
    check_unused_patterns,
    format_rules_table,
)

__all__ = ["MuonOptimizersContainer", "build_muon_optimizers", "resolve_optimizer_cls"]


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def resolve_optimizer_cls(cfg: MuonConfig) -> type[Optimizer]:
    """The optimizer class ``[optimizer.muon]`` selects (``state_dtype`` != fp32: MuonLP)."""
    from muon_plugin import Muon, MuonForeach, MuonLP

    if cfg.state_dtype != "fp32":
        return MuonLP  # raises an ImportError naming the `lp` extra if torchao is missing
    return MuonForeach if cfg.implementation == "foreach" else Muon


def optimizer_kwargs(optimizer_config: Any, cfg: MuonConfig) -> dict[str, Any]:
    """Constructor arguments (the defaults of every group) from ``[optimizer]`` +
    ``[optimizer.muon]``."""
    beta1 = optimizer_config.beta1 if cfg.adam_beta1 is None else cfg.adam_beta1
    beta2 = optimizer_config.beta2 if cfg.adam_beta2 is None else cfg.adam_beta2
    eps = optimizer_config.eps if cfg.adam_eps is None else cfg.adam_eps
    return {
        "lr": optimizer_config.lr,
        "wd": optimizer_config.weight_decay,
        "use_cautious_wd": cfg.cautious_weight_decay,
        "momentum": cfg.momentum,
        "nesterov": cfg.nesterov,
        "ns_steps": cfg.ns_steps,
        "orthogonalization_strategy": cfg.orthogonalization,
        "adam_betas": (beta1, beta2),
        "adam_eps": eps,
        "fused_adam": getattr(optimizer_config, "implementation", "fused") == "fused",
        "compile": cfg.compile,
        "lr_adjust": cfg.lr_adjust,
        "flatten": cfg.flatten,
    }


def low_precision_kwargs(cfg: MuonConfig) -> dict[str, Any]:
    """MuonLP's extra arguments (none for fp32 state)."""
    if cfg.state_dtype == "fp32":
        return {}
    kwargs: dict[str, Any] = {"state_dtype": cfg.state_dtype}
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    return kwargs


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with one Muon optimizer per model part built from
    the param groups of :func:`muon_plugin.param_groups.rules.build_param_groups`.

    Attributes: ``optimizers`` (one per model part), ``group_classes`` (per part, the class of
    each param group), ``rules`` (the :class:`RuleSet` used).
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: dict[str, Any],
        rules: RuleSet,
    ) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        self.rules = rules
        self.group_classes: list[list[str]] = []
        all_params: list[nn.Parameter] = []
        used: set[tuple[str, str]] = set()
        for model in model_parts:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups, classes = build_param_groups(
                named,
                rules,
                lr=optimizer_kwargs["lr"],
                weight_decay=optimizer_kwargs["wd"],
                used_patterns=used,
            )
            self.optimizers.append(optimizer_cls(groups, **optimizer_kwargs))
            self.group_classes.append(classes)
            all_params.extend(p for _, p in named)
        check_unused_patterns(rules, used)
        self._validate_length(len(self.model_parts))
        self._post_init(all_params, optimizer_kwargs)

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
            if fmt is None:
                continue
            text = fmt()
            if text:
                title = f"model part {i}:\n" if len(self.optimizers) > 1 else ""
                reports.append(title + text)
        return "\n".join(reports) if reports else None


def _check_supported(optimizer_config: Any, parallel_dims: Any, ft_manager: Any) -> None:
    if getattr(optimizer_config, "early_step_in_backward", False):
        raise NotImplementedError(
            "optimizer.name = 'muon' does not support optimizer.early_step_in_backward = true: "
            "Muon orthogonalizes whole matrices from all shards at once, and torchtitan's "
            "in-backward container builds one optimizer per parameter. Set "
            "optimizer.early_step_in_backward = false."
        )
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError(
            "optimizer.name = 'muon' does not support torchtitan's fault-tolerant (torchft) "
            "optimizer container yet; disable fault_tolerance or use AdamW."
        )


def build_muon_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: Any,
    ft_manager: Any = None,
) -> MuonOptimizersContainer:
    """torchtitan ``build_optimizers_fn`` for ``optimizer.name = "muon"``."""
    _check_supported(optimizer_config, parallel_dims, ft_manager)
    cfg = getattr(optimizer_config, "muon", None)
    if cfg is None:
        cfg = MuonConfig()
        logger.warning(
            "optimizer.name = 'muon' but the job config has no [optimizer.muon] section "
            "(job.custom_config_module is not muon_plugin.torchtitan?): using the defaults"
        )
    cfg.validate()
    rules = cfg.rules()
    optimizer_cls = resolve_optimizer_cls(cfg)
    kwargs = optimizer_kwargs(optimizer_config, cfg)
    kwargs.update(low_precision_kwargs(cfg))
    container = MuonOptimizersContainer(model_parts, optimizer_cls, kwargs, rules)

    if cfg.log_plan and _is_rank0():
        logger.info(
            f"Muon optimizer: {optimizer_cls.__name__}, {cfg.orthogonalization} "
            f"x{cfg.ns_steps}, momentum {cfg.momentum}"
            f"{' (nesterov)' if cfg.nesterov else ''}, lr_adjust {cfg.lr_adjust}, "
            f"cautious wd {cfg.cautious_weight_decay}, adam betas {kwargs['adam_betas']} "
            f"eps {kwargs['adam_eps']}, fused adam {kwargs['fused_adam']}, "
            f"state dtype {cfg.state_dtype}\nMuon param groups:\n{container.format_rules()}"
        )
    if cfg.log_plan:
        _log_plan_after_first_step(container)
    return container


def _log_plan_after_first_step(container: MuonOptimizersContainer) -> None:
    """Log the orthogonalization plan (rank 0) once, after the first optimizer step."""
    done = False

    def hook(*args: Any, **kwargs: Any) -> None:
        # Not removed from inside the hook: torch iterates the hook dict while calling it.
        nonlocal done
        if done:
            return
        done = True
        if not _is_rank0():
            return
        try:
            report = container.format_plan_report()
        except Exception as e:  # a report must never stop training
            logger.warning(f"Muon: could not format the orthogonalization plan: {e!r}")
            return
        if report:
            logger.info(
                report
                if report.lstrip().lower().startswith("muon")
                else f"Muon orthogonalization plan:\n{report}"
            )

    container.register_step_post_hook(hook)
