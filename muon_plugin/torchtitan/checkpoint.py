"""torchtitan's checkpoint loading, for both releases: what a resume logs about the lr, and a
clear error when a checkpoint holds another optimizer's state (e.g. AdamW -> Muon).

:func:`install` wraps ``dcp_load`` of torchtitan's DCP ``CheckpointManager`` (0.2.2's
``torchtitan.components.checkpoint``, 0.3's ``torchtitan.components.checkpointer.dcp``): before
loading, every rank compares the optimizer state this job expects with the checkpoint's metadata:

- another optimizer's state is refused by name (:mod:`muon_plugin.adapter.foreign_state`);
- a group setting the checkpoint does not have (saved by a version before the setting existed)
  takes the job's value with one log line, instead of DCP's ``Missing key in checkpoint
  state_dict`` (the job's settings win on a resume anyway: :mod:`muon_plugin.adapter.resume`).
"""

from __future__ import annotations

import functools
from typing import Any

from muon_plugin.adapter.foreign_state import check_state_names, foreign_flat_state
from muon_plugin.adapter.job import is_rank0
from muon_plugin.adapter.resume import SCHEDULED_KEYS
from muon_plugin.param_groups.rules import strip_fqn

__all__ = [
    "LR_HINT",
    "WAY_OUT",
    "JobValuesForMissingSettings",
    "check_optimizer_state",
    "install",
    "missing_group_settings",
]

_MARK = "_muon_plugin_hook"

LR_HINT = (
    "the LR scheduler resumes from the checkpoint's base lr, as torchtitan does for every "
    "optimizer; to apply a new lr, resume with --checkpoint.exclude_from_loading lr_scheduler "
    "(the schedule restarts)"
)
"""What a resume whose job lr differs from the checkpoint's logs."""

WAY_OUT = (
    "resume with --checkpoint.exclude_from_loading optimizer,lr_scheduler: the model weights "
    "and the step load, the optimizer state starts fresh and the LR schedule restarts"
)
"""How a torchtitan job loads a checkpoint without its optimizer state."""


def check_optimizer_state(
    optimizers: Any, saved_keys: Any, checkpoint_id: str, optimizer_name: str
) -> None:
    """Raise ValueError when the checkpoint's optimizer state is another optimizer's.

    ``optimizers``: torchtitan's container; ``saved_keys``: the checkpoint's flattened keys.
    """
    expected = [f"optimizer.{k}" for k in optimizers.state_dict() if k.startswith("state.")]
    fqns = {strip_fqn(n) for m in optimizers.model_parts for n, _ in m.named_parameters()}
    found = foreign_flat_state(expected, saved_keys, fqns, prefix="optimizer.")
    check_state_names(found, checkpoint_id, f"optimizer.name = {optimizer_name!r}", WAY_OUT)


def missing_group_settings(template: Any, saved_keys: Any, prefix: str = "optimizer.") -> list[str]:
    """The flattened group-setting keys (``param_groups.<fqn>.<key>``, not the scheduler's
    ``lr`` / ``initial_lr``) of ``template`` that the checkpoint lacks."""
    saved = set(saved_keys)
    return [
        key
        for key in template
        if key.startswith("param_groups.")
        and key.rsplit(".", 1)[1] not in SCHEDULED_KEYS
        and prefix + key not in saved
    ]


class JobValuesForMissingSettings:
    """The container as DCP loads it when the checkpoint lacks some group settings: its state
    dict without them, and a load that takes the job's values for them."""

    def __init__(self, optimizers: Any, missing: list[str]) -> None:
        self.optimizers, self.missing = optimizers, set(missing)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizers.state_dict().items() if k not in self.missing}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        job = self.optimizers.state_dict()
        self.optimizers.load_state_dict({**state_dict, **{k: job[k] for k in self.missing}})


def _manager_class() -> Any:
    """torchtitan's DCP ``CheckpointManager`` (0.3 moved it; 0.2.2 has the old module only)."""
    try:
        from torchtitan.components.checkpointer import dcp as ckpt_module
    except ImportError:
        from torchtitan.components import checkpoint as ckpt_module
    return ckpt_module.CheckpointManager


def _log_missing(missing: list[str], checkpoint_id: str) -> None:
    if not is_rank0():
        return
    from torchtitan.tools.logging import logger

    keys = sorted({key.rsplit(".", 1)[1] for key in missing})
    logger.warning(
        f"Muon: checkpoint {checkpoint_id} has no {', '.join(keys)} setting (saved by a version "
        "before it existed): the job's value is used"
    )


def install() -> None:
    """Wrap ``CheckpointManager.dcp_load`` once (idempotent)."""
    manager = _manager_class()
    original = manager.dcp_load
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def dcp_load(
        self: Any, state_dict: dict[str, Any], checkpoint_id: str, *args: Any, **kwargs: Any
    ) -> None:
        from_hf = kwargs.get("from_hf", args[0] if args else False)
        optimizers = state_dict.get("optimizer")
        if not from_hf and optimizers is not None and hasattr(optimizers, "model_parts"):
            from torch.distributed.checkpoint import FileSystemReader

            try:
                saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            except OSError:  # not a local folder, or no metadata: dcp.load reports that itself
                saved = None
            except Exception as e:  # a truncated or foreign metadata file
                raise ValueError(
                    f"checkpoint {checkpoint_id}: its metadata file cannot be read ({e!r}); "
                    "the checkpoint is incomplete or damaged (was its save interrupted?)"
                ) from e
            inner = getattr(optimizers, "optimizers", None) or [optimizers]
            job = getattr(optimizers, "optimizer_name", None) or type(inner[0]).__name__
            if saved is not None:
                check_optimizer_state(optimizers, saved, checkpoint_id, job)
                missing = missing_group_settings(optimizers.state_dict(), saved)
                if missing:
                    _log_missing(missing, checkpoint_id)
                    wrapped = JobValuesForMissingSettings(optimizers, missing)
                    state_dict = {**state_dict, "optimizer": wrapped}
        return original(self, state_dict, checkpoint_id, *args, **kwargs)

    setattr(dcp_load, _MARK, True)
    manager.dcp_load = dcp_load
