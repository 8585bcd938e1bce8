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
    format_plan_report,
    format_rules,
    is_rank0,
    log_build,
    with_config_key,
)
from muon_plugin.param_groups.options import MuonConfig, validate_optimizer_section

__all__ = [
    "MuonOptimizersContainer",
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


# Group keys a checkpoint restores: the LR scheduler owns lr / initial_lr (see load_state_dict).
_SCHEDULED_KEYS = frozenset({"params", "lr", "initial_lr"})


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. tensors
        return a is b


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with one Muon optimizer per model part built by
    :func:`muon_plugin.param_groups.builder.build_part_optimizers`.

    Attributes: ``optimizers`` (one per model part), ``group_classes`` (per part, the class of
    each param group), ``rules`` (the :class:`RuleSet` used), ``built`` (what the build
    returned), ``changes_on_load`` (the group settings the last ``load_state_dict`` replaced by
    the job's, as logged).
    """

    optimizer_name = "muon"

    def __init__(
        self, model_parts: list[nn.Module], cfg: MuonConfig, base: BaseHyperparams
    ) -> None:
        built = build_part_optimizers(model_parts, cfg, base)
        self.model_parts = model_parts
        self.optimizers = built.optimizers
        self.group_classes = built.group_classes
        self.rules = built.rules
        self.built = built
        self.changes_on_load: list[str] = []
        self._validate_length(len(self.model_parts))
        self._post_init(built.params, built.kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint, keeping this job's group settings.

        ``torch.optim`` restores every saved group setting, which would silently override a
        changed ``ns_steps``, ``weight_decay``, ``momentum``, ... of the resumed job. Here the
        job wins for every key the plugin builds groups from; ``lr`` and ``initial_lr`` come
        from the checkpoint, because torchtitan's LR scheduler resumes from its saved base
        learning rates (as it does for AdamW). What changed is logged (rank 0) with the table.
        """
        wanted = [
            [{k: v for k, v in g.items() if k not in _SCHEDULED_KEYS} for g in opt.param_groups]
            for opt in self.optimizers
        ]
        job_lrs = [
            [g.get("initial_lr", g["lr"]) for g in opt.param_groups] for opt in self.optimizers
        ]
        super().load_state_dict(state_dict)
        changed: dict[tuple[str, str, str], list[str]] = {}
        lr_changed: dict[tuple[str, str], list[str]] = {}
        for opt, groups, lrs, classes in zip(
            self.optimizers, wanted, job_lrs, self.group_classes, strict=True
        ):
            for g, want, job_lr, c in zip(opt.param_groups, groups, lrs, classes, strict=True):
                for k, v in want.items():
                    if k != "param_names" and not _same(g.get(k), v):
                        changed.setdefault((k, repr(g.get(k)), repr(v)), []).append(c)
                    g[k] = v
                saved_lr = g.get("initial_lr", g["lr"])
                if not _same(float(saved_lr), float(job_lr)):
                    lr_changed.setdefault((f"{job_lr:.3g}", f"{saved_lr:.3g}"), []).append(c)
        changes = [
            f"{k}: {old} (checkpoint) -> {new} (job) in {', '.join(classes)}"
            for (k, old, new), classes in changed.items()
        ]
        lr_notes = [
            f"job {job}, checkpoint {saved} in {', '.join(classes)}"
            for (job, saved), classes in lr_changed.items()
        ]
        self.changes_on_load = changes
        if (changes or lr_notes) and is_rank0():
            text = ""
            if changes:
                text += "Muon: the job's settings replace the checkpoint's: " + "; ".join(changes)
            if lr_notes:
                text += (
                    ("\n" if text else "")
                    + "Muon: base lr differs from the checkpoint's ("
                    + "; ".join(lr_notes)
                    + "): the LR scheduler resumes from the checkpoint's base lr, as torchtitan "
                    "does for every optimizer; to apply a new lr, resume with "
                    "--checkpoint.exclude_from_loading lr_scheduler (the schedule restarts)"
                )
            logger.warning(text)
            logger.info(f"Muon param groups after loading the checkpoint:\n{self.format_rules()}")

    def format_rules(self) -> str:
        """The param-group table(s), one per model part."""
        return format_rules(self.optimizers, self.group_classes)

    def format_plan_report(self) -> str | None:
        """The optimizers' distributed orthogonalization plans, if they report one."""
        return format_plan_report(self.optimizers)


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
) -> MuonOptimizersContainer:
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
    container = MuonOptimizersContainer(model_parts, cfg, base_hyperparams(optimizer_config))
    log_build(
        container.built, cfg, container.register_step_post_hook, container.format_plan_report,
        logger,
    )  # fmt: skip
    return container
