"""A clear error when a checkpoint holds another optimizer's state (e.g. AdamW -> Muon).

Without it, resuming a checkpoint written with ``optimizer.name = "AdamW"`` under
``optimizer.name = "muon"`` fails inside ``torch.distributed.checkpoint`` with a bare
``Missing key in checkpoint state_dict: optimizer.state.<fqn>.momentum_buffer``.
:func:`install` wraps torchtitan 0.2.2's ``CheckpointManager.dcp_load``: before loading, every
rank compares the optimizer state this job expects with the checkpoint's metadata and, when a
parameter has saved state under other names, raises a ValueError that names the parameter, both
sets of state names and the flag that loads the model without the optimizer.

It raises rather than silently starting the optimizer fresh: dropping the optimizer state
also restarts the LR schedule (its saved base learning rates are per param group, and Muon
builds other groups than AdamW), which changes the run; the user chooses that explicitly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from muon_plugin.param_groups.rules import strip_fqn

__all__ = ["check_optimizer_state", "foreign_state", "install"]

_MARK = "_muon_plugin_hook"
_PREFIX = "optimizer.state."


def _state_names(keys: Iterable[str], fqns: set[str]) -> dict[str, set[str]]:
    """``{fqn: {state name, ...}}`` from flattened ``optimizer.state.<fqn>.<name>`` keys."""
    out: dict[str, set[str]] = {}
    for key in keys:
        if not key.startswith(_PREFIX):
            continue
        rest = key[len(_PREFIX) :]
        dot = rest.find(".")
        while dot != -1:
            if rest[:dot] in fqns:
                out.setdefault(rest[:dot], set()).add(rest[dot + 1 :].split(".", 1)[0])
                break
            dot = rest.find(".", dot + 1)
    return out


def foreign_state(
    expected: Iterable[str], saved: Iterable[str], fqns: Iterable[str]
) -> tuple[str, set[str], set[str]] | None:
    """The first parameter whose saved optimizer state lacks names this job expects while it
    has others: ``(fqn, expected names, saved names)``; ``None`` if there is none."""
    fqns = set(fqns)
    want = _state_names(expected, fqns)
    have = _state_names(saved, fqns)
    for fqn in sorted(want):
        if fqn in have and not want[fqn] <= have[fqn]:
            return fqn, want[fqn], have[fqn]
    return None


def check_optimizer_state(
    optimizers: Any, saved_keys: Iterable[str], checkpoint_id: str, optimizer_name: str
) -> None:
    """Raise ValueError when the checkpoint's optimizer state is another optimizer's."""
    expected = [f"optimizer.{k}" for k in optimizers.state_dict() if k.startswith("state.")]
    fqns = {strip_fqn(n) for m in optimizers.model_parts for n, _ in m.named_parameters()}
    found = foreign_state(expected, saved_keys, fqns)
    if found is None:
        return
    fqn, want, have = found
    raise ValueError(
        f"checkpoint {checkpoint_id} holds the state of another optimizer: for {fqn} it has "
        f"{', '.join(sorted(have))}, while this job's optimizer (optimizer.name = "
        f"{optimizer_name!r}) needs {', '.join(sorted(want))}. To switch optimizers, resume "
        "with --checkpoint.exclude_from_loading optimizer,lr_scheduler: the model weights and "
        "the step load, the optimizer state starts fresh and the LR schedule restarts"
    )


def install() -> None:
    """Wrap ``CheckpointManager.dcp_load`` once (idempotent)."""
    from torchtitan.components import checkpoint as ckpt_module

    original = ckpt_module.CheckpointManager.dcp_load
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def dcp_load(
        self: Any, state_dict: dict[str, Any], checkpoint_id: str, *args: Any, **kwargs: Any
    ) -> None:
        from_hf = kwargs.get("from_hf", args[0] if args else False)
        optimizers = state_dict.get(ckpt_module.OPTIMIZER)
        if not from_hf and optimizers is not None and hasattr(optimizers, "model_parts"):
            from torch.distributed.checkpoint import FileSystemReader

            try:
                saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            except OSError:  # no readable metadata: dcp.load reports that itself
                saved = None
            inner = getattr(optimizers, "optimizers", None) or [optimizers]
            job = getattr(optimizers, "optimizer_name", None) or type(inner[0]).__name__
            if saved is not None:
                check_optimizer_state(optimizers, saved, checkpoint_id, job)
        return original(self, state_dict, checkpoint_id, *args, **kwargs)

    setattr(dcp_load, _MARK, True)
    ckpt_module.CheckpointManager.dcp_load = dcp_load
