"""torchtitan 0.3's ``OptimizersContainer`` with one Muon optimizer per model part.

``MuonOptimizersContainer.Config`` is a drop-in ``optimizer=`` of a torchtitan 0.3
``Trainer.Config``: the job's base hyperparameters (``lr``, ``weight_decay``, ``beta1``,
``beta2``, ``eps``) as fields, the Muon options under ``muon`` (the one option schema,
:class:`muon_plugin.param_groups.options.MuonConfig`; CLI flags ``--optimizer.muon.<option>``,
documented in ``--help``) and ``muon_toml``, a TOML file whose ``[optimizer.muon]`` table
(the 0.2.2 job config's) sets every option left at its default. The param groups come from the
class rules (:mod:`muon_plugin.param_groups.rules`), not from ``param_groups``, which must stay
empty.

Checkpoints keep torchtitan 0.3's contract: every group has ``param_names``, the state is saved
flattened as ``state.{fqn}.{key}`` and the zero-grad, lr-0 init step leaves parameters
unchanged. LR schedulers (one ``LambdaLR`` per inner optimizer, scaling each group's own
initial lr), gradient clipping and the MoE load-balancing hook work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from muon_plugin.adapter.job import JobContainerMixin, build_job_optimizers
from muon_plugin.adapter.qk_clip import attach_qk_clip, build_qk_clip
from muon_plugin.adapter.resume import keep_job_settings_on_load
from muon_plugin.param_groups.builder import BaseHyperparams
from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.param_groups.table import apply_table, read_muon_table
from muon_plugin.torchtitan.checkpoint import LR_HINT
from muon_plugin.torchtitan03.qk_clip import (
    describe_attention,
    qk_clip_group,
    remember_parallel_dims,
    remembered_parallel_dims,
)

__all__ = ["MuonOptimizersContainer", "resolve_muon_config"]


def resolve_muon_config(config: MuonOptimizersContainer.Config) -> MuonConfig:
    """The Muon options in force: ``config.muon`` plus the ``muon_toml`` file's table."""
    cfg = config.muon
    if config.muon_toml:
        cfg = apply_table(cfg, read_muon_table(config.muon_toml))
    cfg.validate()
    return cfg


class MuonOptimizersContainer(JobContainerMixin, OptimizersContainer):
    """One Muon optimizer per model part holding all its param groups (Muon and AdamW), built
    by the adapter core (:func:`muon_plugin.adapter.job.build_job_optimizers`).

    A checkpoint load keeps this job's group settings and logs what changed
    (:func:`muon_plugin.adapter.resume.keep_job_settings_on_load`; ``lr`` and ``initial_lr``
    come from the checkpoint, as torchtitan's LR scheduler resumes from its own state).
    Attributes: see :class:`~muon_plugin.adapter.job.JobContainerMixin`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 8e-4
        """Learning rate of every parameter class (an AdamW-style value: the Muon groups use
        optimizer.muon.lr_adjust = 'match_rms_adamw' by default); per class:
        optimizer.muon.<class>_lr."""

        weight_decay: float = 0.1
        """Weight decay of every parameter class; per class: optimizer.muon.<class>_weight_decay."""

        beta1: float = 0.9
        """beta1 of the Adam(W) groups (optimizer.muon.adam_beta1 overrides it)."""

        beta2: float = 0.95
        """beta2 of the Adam(W) groups (optimizer.muon.adam_beta2 overrides it)."""

        eps: float = 1e-8
        """Epsilon of the Adam(W) groups (optimizer.muon.adam_eps overrides it)."""

        muon: MuonConfig = field(default_factory=MuonConfig)
        """Muon options (the [optimizer.muon] table of torchtitan 0.2.2 job configs)."""

        muon_toml: str = ""
        """A TOML file whose [optimizer.muon] table sets every optimizer.muon option left at its
        default here (a torchtitan 0.2.2 job TOML works as is)."""

        def __post_init__(self) -> None:
            if self.param_groups:
                raise ValueError(
                    "optimizer.param_groups: must be empty with MuonOptimizersContainer, whose "
                    "param groups come from the class rules (optimizer.muon.<class>_patterns, "
                    "<class>_algorithm, <class>_lr, <class>_weight_decay)"
                )
            if self.implementation == "fused_opt_states_bf16":
                raise ValueError(
                    "optimizer.implementation: 'fused_opt_states_bf16' is not supported by "
                    "Muon; use optimizer.muon.state_dtype = 'bf16' for bf16 optimizer states"
                )
            remember_parallel_dims()  # QK-Clip's data-parallel group (the trainer's meshes)

        def base_hyperparams(self) -> BaseHyperparams:
            """The defaults every parameter class starts from."""
            return BaseHyperparams(
                lr=self.lr,
                weight_decay=self.weight_decay,
                beta1=self.beta1,
                beta2=self.beta2,
                eps=self.eps,
                fused=self.implementation == "fused",
            )

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        job = build_job_optimizers(
            model_parts, resolve_muon_config(config), config.base_hyperparams()
        )
        self.model_parts = model_parts
        self._attach_job(job)
        self._post_init(job.params)
        keep_job_settings_on_load(job, lr_from="checkpoint", log=logger, lr_hint=LR_HINT)
        if job.config.qk_clip_tau is not None:
            dims = remembered_parallel_dims()
            pipeline = bool(getattr(dims, "pp_enabled", False))
            job.qk_clip = build_qk_clip(
                model_parts, job.config, describe_attention, qk_clip_group(dims), pipeline=pipeline
            )
        job.log_build(self.register_step_post_hook, logger)
        attach_qk_clip(job.qk_clip, self.register_step_post_hook, logger)
