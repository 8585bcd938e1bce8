"""A torchtune resume of a Muon run: the checkpoint's optimizer state must be Muon's.

torchtune 0.6.1 resumes the optimizer from the rank-0 full state dict in ``recipe_state.pt``
(state keyed by parameter name) or, with ``enable_async_checkpointing``, from the latest
``dist_epoch_N`` DCP folder (state keyed by position). Another optimizer's state (an AdamW run
resumed with Muon) fails there with a param-group count mismatch, or, on the DCP path, is caught
by the recipe, which warns and starts from the base checkpoint. :func:`check_resumed_state`
refuses it first, naming the parameter, both sets of state names and the way out. The group
settings themselves are the job's on every path (:func:`muon_plugin.torchtune.component.muon`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer

from muon_plugin.adapter.foreign_state import (
    check_state_names,
    foreign_param_state,
    foreign_state_names,
)
from muon_plugin.torchtune.options import SECTION, TorchtuneConfigError

__all__ = ["WAY_OUT", "check_resumed_state", "dcp_state_names"]

WAY_OUT = (
    "start from the saved model weights without resuming (resume_from_checkpoint: false, "
    "checkpointer.checkpoint_dir and checkpoint_files naming the saved model files): the "
    "optimizer state starts fresh"
)
"""How a torchtune job loads a checkpoint without its optimizer state."""

_JOB = f"{SECTION}._component_: muon_plugin.torchtune.muon"
_DCP_PREFIX = "optimizer.state."


def dcp_state_names(folder: str) -> set[str]:
    """The optimizer state names in a DCP checkpoint folder's metadata (``optimizer.state.<id>.
    <name>`` keys); empty when the folder has no readable metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    except OSError:
        return set()
    names = set()
    for key in keys:
        if key.startswith(_DCP_PREFIX):
            parts = key[len(_DCP_PREFIX) :].split(".")
            if len(parts) >= 2:
                names.add(parts[1])
    return names


def check_resumed_state(
    optimizer: Optimizer,
    full_state: Mapping[str, Any] | None,
    dcp_folder: str | None,
    where: str,
) -> None:
    """Raise :class:`TorchtuneConfigError` when the resumed optimizer state is not Muon's.

    ``full_state``: the full optimizer state dict torchtune loads (or None); ``dcp_folder``: the
    DCP folder it loads on the async path (or None); ``where``: the checkpoint, for the message.
    """
    try:
        if full_state:
            found = foreign_param_state(optimizer, full_state.get("state", {}))
            check_state_names(found, where, _JOB, WAY_OUT)
        if dcp_folder:
            found = foreign_state_names(optimizer, dcp_state_names(dcp_folder))
            check_state_names(found, dcp_folder, _JOB, WAY_OUT)
    except ValueError as e:
        raise TorchtuneConfigError(str(e)) from None
