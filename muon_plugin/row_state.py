"""NorMuon's per-row second moment as optimizer state: created like its parameter's rows,
checked and laid out when loaded.

The state of a Muon parameter whose group normalizes rows (``normalization = "normuon"``) is
one fp32 entry per row of each of its matrices, ``spec.row_shape(p.shape)`` (``shape[:-1]``;
``(shape[0],)`` when flattened), under :data:`ROW_STATE_KEY`. For a DTensor parameter it is a
DTensor on the parameter's mesh, sharded like the parameter's rows: the parameter's placements
with the mesh dims that cut a column dim replicated
(:func:`~muon_plugin.distributed.layout.row_placements`). So ``state_dict()`` saves it by the
parameter's name and DCP reshards it like the momentum when a run resumes at another layout;
the plan carries each matrix's rows to its owner and back every step.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.distributed.layout import normalize_placements, row_placements
from muon_plugin.orthogonalize import MatrixSpec
from muon_plugin.parameters import describe, local
from muon_plugin.state_layout import like_param, match_layout

ROW_STATE_KEY = "normuon_second_moment"
"""The state key of NorMuon's per-row second moment."""


def row_state_placements(p: DTensor, spec: MatrixSpec) -> tuple[Any, ...]:
    """The placements of ``p``'s per-row state on ``p``'s mesh."""
    shape = tuple(p.shape)
    placements = normalize_placements(tuple(p.placements), len(shape), tuple(p.device_mesh.shape))
    return row_placements(placements, len(spec.row_shape(shape)))


def zero_row_state(p: Tensor, spec: MatrixSpec) -> Tensor:
    """A zero per-row state for ``p`` (fp32; a DTensor laid out like ``p``'s rows)."""
    lp = local(p)
    state = torch.zeros(spec.row_shape(tuple(lp.shape)), dtype=torch.float32, device=lp.device)
    if not isinstance(p, DTensor):
        return state
    return like_param(p, state, spec.row_shape(tuple(p.shape)), row_state_placements(p, spec))


def check_row_state(p: Tensor, state: Tensor, spec: MatrixSpec) -> Tensor:
    """``state``'s local tensor, after checking that it is ``p``'s per-row state: fp32, laid
    out like ``p``'s rows. Raises ValueError saying what differs (the caller names ``p``)."""
    expected = spec.row_shape(tuple(local(p).shape))
    got = local(state)
    if tuple(got.shape) != expected or got.dtype != torch.float32:
        raise ValueError(
            f"{ROW_STATE_KEY!r} has local shape {tuple(got.shape)} ({got.dtype}); NorMuon needs "
            f"fp32 of shape {expected}, one entry per row of the local shard"
        )
    return got


def restore_row_state(p: Tensor, saved: Tensor, spec: MatrixSpec) -> Tensor:
    """A loaded per-row state for ``p``: checked against ``p``'s rows (global shape), fp32, on
    ``p``'s device and laid out like ``p``'s rows. Raises ValueError naming the key."""
    if not isinstance(saved, Tensor):
        raise ValueError(f"{ROW_STATE_KEY!r} is a {type(saved).__name__}, not a tensor")
    expected = spec.row_shape(tuple(p.shape))
    if tuple(saved.shape) != expected or not saved.is_floating_point():
        raise ValueError(
            f"{ROW_STATE_KEY!r} has shape {tuple(saved.shape)} ({saved.dtype}); expected a "
            f"floating tensor of shape {expected}, one entry per row"
        )
    placements = row_state_placements(p, spec) if isinstance(p, DTensor) else None
    return match_layout(p, saved.to(torch.float32), placements)


CheckedRows = dict[Tensor, tuple[Tensor, torch.Size, bool, Tensor]]
"""Per parameter, the row state last checked for it, with what the check depended on (its shape
and whether its matrices are flattened) and the checked local tensor."""


def group_row_states(
    state: MutableMapping[Tensor, dict[str, Any]],
    group: Mapping[str, Any],
    ps: list[Tensor],
    spec: MatrixSpec,
    checked: CheckedRows | None = None,
) -> list[Tensor | None]:
    """The local per-row states of ``ps`` (Muon parameters of ``group`` with gradients), each
    created zero where ``state`` (the optimizer's) has none and checked against its parameter;
    Nones when the group does not normalize rows.

    ``checked`` (the caller's, kept between steps) skips the check of a state already checked
    for the same parameter, shape and flattening: the step's host work before its first kernel
    stays that of Muon's (a state replaced, by a load or by hand, is checked again).
    """
    if spec.normalization is None:
        return [None] * len(ps)
    out: list[Tensor | None] = []
    for p in ps:
        entry = state[p]
        saved = entry.get(ROW_STATE_KEY)
        if saved is None:
            saved = entry[ROW_STATE_KEY] = zero_row_state(p, spec)
        hit = None if checked is None else checked.get(p)
        if hit is not None and hit[0] is saved and hit[1] == p.shape and hit[2] == spec.flatten:
            out.append(hit[3])
            continue
        try:
            got = check_row_state(p, saved, spec)
        except ValueError as e:
            i = next(i for i, q in enumerate(group["params"]) if q is p)
            raise ValueError(f"the state of {describe(group, i, p)}: {e}") from None
        if checked is not None:
            checked[p] = (saved, p.shape, spec.flatten, got)
        out.append(got)
    return out
