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

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from muon_plugin.param_groups.builder import (
    BaseHyperparams,
    build_part_optimizers,
    format_build_summary,
    format_plan_report,
    format_rules,
    is_rank0,
    log_plan_after_first_step,
)
from muon_plugin.param_groups.options import MuonConfig

__all__ = ["MuonOptimizersContainer", "base_hyperparams", "build_muon_optimizers"]


def base_hyperparams(optimizer_config: Any) -> BaseHyperparams:
    """The ``[optimizer]`` section's lr / weight decay / betas / eps / implementation."""
    return BaseHyperparams(
        lr=optimizer_config.lr,
        weight_decay=optimizer_config.weight_decay,
        beta1=optimizer_config.beta1,
        beta2=optimizer_config.beta2,
        eps=optimizer_config.eps,
        fused=getattr(optimizer_config, "implementation", "fused") == "fused",
    )


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with one Muon optimizer per model part built by
    :func:`muon_plugin.param_groups.builder.build_part_optimizers`.

    Attributes: ``optimizers`` (one per model part), ``group_classes`` (per part, the class of
    each param group), ``rules`` (the :class:`RuleSet` used).
    """

    def __init__(
        self, model_parts: list[nn.Module], cfg: MuonConfig, base: BaseHyperparams
    ) -> None:
        built = build_part_optimizers(model_parts, cfg, base)
        self.model_parts = model_parts
        self.optimizers = built.optimizers
        self.group_classes = built.group_classes
        self.rules = built.rules
        self.built = built
        self._validate_length(len(self.model_parts))
        self._post_init(built.params, built.kwargs)

    def format_rules(self) -> str:
        """The param-group table(s), one per model part."""
        return format_rules(self.optimizers, self.group_classes)

    def format_plan_report(self) -> str | None:
        """The optimizers' distributed orthogonalization plans, if they report one."""
        return format_plan_report(self.optimizers)


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
    container = MuonOptimizersContainer(model_parts, cfg, base_hyperparams(optimizer_config))
    if cfg.log_plan and is_rank0():
        logger.info(format_build_summary(container.built, cfg))
    if cfg.log_plan:
        log_plan_after_first_step(
            container.register_step_post_hook, container.format_plan_report, logger
        )
    return container
