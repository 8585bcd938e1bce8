"""A clear error when a checkpoint holds another optimizer's state (e.g. AdamW -> Muon).

Without it, resuming a checkpoint written by another optimizer fails deep inside the
framework's loader (``torch.distributed.checkpoint``'s bare ``Missing key in checkpoint
state_dict: optimizer.state.<fqn>.momentum_buffer``, or a param-group count mismatch), or, where
the loader is lenient, Muon would start from no momentum without a word. The check raises a
ValueError naming the parameter, both sets of state names and the framework's way to load the
model without the optimizer state. It raises rather than silently starting the optimizer fresh:
dropping the optimizer state also restarts the LR schedule in torchtitan, which changes the run;
the user chooses that explicitly.

Two forms of saved state are read:

- flattened keys ``<prefix>state.<fqn>.<name>`` (DCP checkpoints of torchtitan and TorchTune's
  DCP path): the job's own flattened keys are what must be there (:func:`foreign_flat_state`);
- a ``torch.optim`` state dict keyed by FQN (TorchTune's full optimizer state dict): each
  parameter's saved names must include some of its algorithm's (:func:`foreign_param_state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch.optim import Optimizer

__all__ = [
    "ADAM_STATE_NAMES",
    "check_state_names",
    "flat_state_names",
    "foreign_flat_state",
    "foreign_param_state",
    "foreign_state_names",
    "is_muon_state_name",
]

ADAM_STATE_NAMES = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""The state names of the Adam / AdamW groups."""

Found = tuple[str, set[str], set[str]]
"""``(fqn, names this job needs, names the checkpoint has)``."""


def is_muon_state_name(name: str) -> bool:
    """Whether ``name`` is a Muon momentum state name (``momentum_buffer``, MuonLP's
    ``momentum_codes``, ``momentum_scales``, ...: every format converts from the others)."""
    return name.startswith("momentum")


def flat_state_names(
    keys: Iterable[str], fqns: Iterable[str], prefix: str = ""
) -> dict[str, set[str]]:
    """``{fqn: {state name, ...}}`` from flattened ``<prefix>state.<fqn>.<name>`` keys."""
    fqns = set(fqns)
    lead = f"{prefix}state."
    out: dict[str, set[str]] = {}
    for key in keys:
        if not key.startswith(lead):
            continue
        rest = key[len(lead) :]
        dot = rest.find(".")
        while dot != -1:
            if rest[:dot] in fqns:
                out.setdefault(rest[:dot], set()).add(rest[dot + 1 :].split(".", 1)[0])
                break
            dot = rest.find(".", dot + 1)
    return out


def foreign_flat_state(
    expected: Iterable[str], saved: Iterable[str], fqns: Iterable[str], prefix: str = ""
) -> Found | None:
    """The first parameter whose saved flattened state lacks names this job expects while it
    has others; ``None`` if there is none."""
    fqns = set(fqns)
    want = flat_state_names(expected, fqns, prefix)
    have = flat_state_names(saved, fqns, prefix)
    for fqn in sorted(want):
        if fqn in have and not want[fqn] <= have[fqn]:
            return fqn, want[fqn], have[fqn]
    return None


def _expected_names(algorithm: str) -> set[str]:
    return (
        {"momentum_buffer"} if algorithm == "muon" else set(ADAM_STATE_NAMES - {"max_exp_avg_sq"})
    )


def foreign_param_state(
    optimizer: Optimizer, saved_state: Mapping[Any, Mapping[str, Any]]
) -> Found | None:
    """The first parameter of ``optimizer`` (groups with ``param_names``) whose entry in
    ``saved_state`` (a ``torch.optim`` state keyed by FQN) holds none of its algorithm's state
    names; ``None`` if there is none."""
    for group in optimizer.param_groups:
        muon = group.get("algorithm", "muon") == "muon"
        for fqn in group.get("param_names", ()):
            names = set(saved_state.get(fqn, {}))
            if not names:
                continue
            ours = (
                any(is_muon_state_name(n) for n in names)
                if muon
                else bool(names & ADAM_STATE_NAMES)
            )
            if not ours:
                return fqn, _expected_names(group.get("algorithm", "muon")), names
    return None


def foreign_state_names(optimizer: Optimizer, saved_names: Iterable[str]) -> Found | None:
    """When a checkpoint's state is known only as a set of names (keyed by position, not by
    parameter): the first parameter of ``optimizer`` whose algorithm has none of its state
    names among ``saved_names``, if ``saved_names`` is not empty; ``None`` otherwise."""
    names = set(saved_names)
    if not names:
        return None
    has_muon = any(is_muon_state_name(n) for n in names)
    has_adam = bool(names & ADAM_STATE_NAMES)
    for group in optimizer.param_groups:
        algorithm = group.get("algorithm", "muon")
        if (has_muon if algorithm == "muon" else has_adam) or not group.get("param_names"):
            continue
        return group["param_names"][0], _expected_names(algorithm), names
    return None


def check_state_names(
    found: Found | None, checkpoint: str, optimizer_name: str, way_out: str
) -> None:
    """Raise ValueError for ``found`` (see :func:`foreign_flat_state`), if any.

    ``checkpoint``: what was loaded (a path); ``optimizer_name``: the job's optimizer as its
    config names it; ``way_out``: how the framework loads the model without the optimizer.
    """
    if found is None:
        return
    fqn, want, have = found
    raise ValueError(
        f"checkpoint {checkpoint} holds the state of another optimizer: for {fqn} it has "
        f"{', '.join(sorted(have))}, while this job's optimizer ({optimizer_name}) needs "
        f"{', '.join(sorted(want))}. To switch optimizers, {way_out}"
    )
