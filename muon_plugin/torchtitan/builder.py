"""Build the Muon optimizer for torchtitan's ``Trainer``: one optimizer per model part.

``build_muon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None)`` has the
signature of torchtitan's ``build_optimizers`` and returns a :class:`MuonOptimizersContainer022`,
a subclass of torchtitan's ``OptimizersContainer`` whose single optimizer per model part holds
all the param groups (Muon and AdamW): torchtitan's checkpointing (``state_dict`` /
``load_state_dict`` with ``flatten_optimizer_state_dict``), LR schedulers (one ``LambdaLR`` per
inner optimizer, scaling each group's own ``initial_lr``), gradient clipping, the MoE
load-balancing pre-step hook and float8 post-step hooks all work unchanged. Everything that is
not torchtitan-specific (the build, the table, the plan report, the resume policy) is the
adapter core's (:mod:`muon_plugin.adapter`).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from muon_plugin.adapter.job import JobContainerMixin, build_job_optimizers
from muon_plugin.adapter.qk_clip import attach_qk_clip, build_qk_clip
from muon_plugin.adapter.resume import keep_job_settings_on_load
from muon_plugin.param_groups.builder import BaseHyperparams, with_config_key
from muon_plugin.param_groups.options import MuonConfig, validate_optimizer_section
from muon_plugin.torchtitan.checkpoint import LR_HINT
from muon_plugin.torchtitan.qk_clip import describe_attention, qk_clip_group

__all__ = [
    "MuonOptimizersContainer022",
    "base_hyperparams",
    "build_muon_optimizers",
    "with_config_key",
]


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


class MuonOptimizersContainer022(JobContainerMixin, OptimizersContainer):
    """torchtitan 0.2.2's ``OptimizersContainer`` with one Muon optimizer per model part, built
    by the adapter core (:func:`muon_plugin.adapter.job.build_job_optimizers`); torchtitan 0.3's
    is :class:`muon_plugin.torchtitan03.container.MuonOptimizersContainer`.

    A checkpoint load keeps this job's group settings and logs what changed
    (:func:`muon_plugin.adapter.resume.keep_job_settings_on_load`; ``lr`` and ``initial_lr``
    come from the checkpoint, as torchtitan's LR scheduler resumes from its own state).
    Attributes: see :class:`~muon_plugin.adapter.job.JobContainerMixin`.
    """

    optimizer_name = "muon"

    def __init__(
        self, model_parts: list[nn.Module], cfg: MuonConfig, base: BaseHyperparams
    ) -> None:
        job = build_job_optimizers(model_parts, cfg, base)
        self.model_parts = model_parts
        self._attach_job(job)
        self._validate_length(len(self.model_parts))
        self._post_init(job.params, job.kwargs)
        keep_job_settings_on_load(job, lr_from="checkpoint", log=logger, lr_hint=LR_HINT)


def _check_supported(optimizer_config: Any, ft_manager: Any) -> None:
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
) -> MuonOptimizersContainer022:
    """torchtitan ``build_optimizers_fn`` for ``optimizer.name = "muon"``."""
    _check_supported(optimizer_config, ft_manager)
    validate_optimizer_section(optimizer_config)
    cfg = getattr(optimizer_config, "muon", None)
    if cfg is None:
        cfg = MuonConfig()
        logger.warning(
            "optimizer.name = 'muon' but the job config has no [optimizer.muon] section "
            "(job.custom_config_module is not muon_plugin.torchtitan?): using the defaults"
        )
    container = MuonOptimizersContainer022(model_parts, cfg, base_hyperparams(optimizer_config))
    if cfg.qk_clip_tau is not None:
        group = qk_clip_group(parallel_dims)
        pipeline = bool(getattr(parallel_dims, "pp_enabled", False))
        container.job.qk_clip = build_qk_clip(
            model_parts, cfg, describe_attention, group, pipeline=pipeline
        )
    container.job.log_build(container.register_step_post_hook, logger)
    attach_qk_clip(container.job.qk_clip, container.register_step_post_hook, logger)
    return container
