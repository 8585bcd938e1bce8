"""The per-row state of a step (NorMuon's second moments) on its way through the executor.

A shape group whose spec normalizes rows has a ``rows`` companion (a
:class:`~muon_plugin.distributed.planner.RowGroup`). Per step, :class:`RowStates` gives the
owner of each unit the unit's rows' states as an fp32 stack ``(slots, rows)``, and after the
owner has computed the rows' factors (:func:`~muon_plugin.orthogonalize.normuon.
normuon_factors_`, updating that stack in place) puts the states back into every local state
holding those rows and hands each parameter its rows' factors.

Where the rows need no traffic (one GPU, expert stacks sharded on the expert dim) that is one
stack of the local states, one copy back, and the factors are views of the owner's stack. Where
they travel, they go as bf16 words (:func:`row_words`: the fp32 bits, unchanged) in the shape
group's own all-to-alls, parts 1 (states) and 2 (factors, on the way back) of each peer's
segment (:mod:`~muon_plugin.distributed.communicator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from muon_plugin.distributed.communicator import InFlight, piece
from muon_plugin.distributed.planner import ROW_WORDS, ShapeGroup
from muon_plugin.distributed.schedule import WIRE_DTYPE
from muon_plugin.orthogonalize.backends import elementwise_kernels_allowed
from muon_plugin.orthogonalize.normuon import normuon_factors_


def row_words(state: Tensor) -> Tensor:
    """An fp32 per-row tensor ``(..., rows)`` as bf16 words ``(..., rows, ROW_WORDS)``: the
    same memory, so the words travel and are written back bit for bit."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"per-row state must be contiguous fp32, got {state.dtype}")
    return state.view(WIRE_DTYPE).view(*state.shape, ROW_WORDS)


class RowStates:
    """One step's per-row states (``rows``: per parameter, its local fp32 state or None) and
    the list ``factors`` that receives each parameter's rows' factors."""

    def __init__(self, rows: Sequence[Tensor | None], factors: list[Tensor | None]) -> None:
        if len(factors) != len(rows):
            raise ValueError(f"{len(factors)} factor slots for {len(rows)} per-row states")
        self.rows, self.factors = rows, factors

    def words(self, group: ShapeGroup) -> dict[int, Tensor]:
        """The group's local states as bf16 words, by parameter position (for the wire)."""
        if group.rows is None or not group.rows.travels:
            return {}
        return {i: row_words(self._state(group, i)) for i in group.indices}

    def _state(self, group: ShapeGroup, i: int) -> Tensor:
        state = self.rows[i]
        if state is None:
            raise ValueError(f"{group.names[0]!r}: its group normalizes rows, but it has no state")
        return state

    def assemble(
        self, group: ShapeGroup, words: dict[int, Tensor], pending: InFlight | None
    ) -> Tensor | None:
        """The states of the units this rank owns, ``(slots, rows)`` fp32; None without a
        ``rows`` companion or owned units. ``pending`` has been waited for."""
        companion = group.rows
        if companion is None or not companion.schedule.slots:
            return None
        sched = companion.schedule
        if not companion.travels:
            assert sched.direct is not None
            pieces = [piece(self._state(group, group.indices[k]), b) for k, b in sched.direct]
            return torch.stack(pieces)
        stack = torch.empty(
            (len(sched.slots), *companion.unit_shape), dtype=WIRE_DTYPE, device=group.device
        )
        dsts, srcs = [], []
        for slot, k, local_b, rects in sched.gather_self:
            part = piece(words[group.indices[k]], local_b)
            for unit_sl, piece_sl in rects:
                dsts.append(stack[slot][unit_sl])
                srcs.append(part[piece_sl])
        if pending is not None:
            for (slot, _, rects), part in pending.received(1):
                for unit_sl, piece_sl in rects:
                    dsts.append(stack[slot][unit_sl])
                    srcs.append(part[piece_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return stack.view(torch.float32).squeeze(-1)

    def scatter(
        self,
        group: ShapeGroup,
        words: dict[int, Tensor],
        pending: InFlight | None,
        states: Tensor | None,
        factor_stack: Tensor | None,
    ) -> None:
        """Put the owner's updated ``states`` back into every local state holding those rows
        and the rows' factors (``factor_stack``, received ones too) into ``factors``."""
        companion = group.rows
        if companion is None:
            return
        if not companion.travels:
            self._scatter_local(group, states, factor_stack)
            return
        shape = group.spec.row_shape(group.local_shape)
        fresh = torch.empty((len(group.indices), *shape), dtype=torch.float32, device=group.device)
        fresh_words = row_words(fresh).unbind(0)
        for k, i in enumerate(group.indices):
            self.factors[i] = fresh[k]
        sched = companion.schedule
        dsts, srcs = [], []
        if sched.back_self:
            assert states is not None and factor_stack is not None
            state_words, factor_words = row_words(states), row_words(factor_stack)
            for slot, k, local_b, rects in sched.back_self:
                state = piece(words[group.indices[k]], local_b)
                factor = piece(fresh_words[k], local_b)
                for unit_sl, piece_sl in rects:
                    dsts += [state[piece_sl], factor[piece_sl]]
                    srcs += [state_words[slot][unit_sl], factor_words[slot][unit_sl]]
        if pending is not None and sched.back_recv:
            received = zip(pending.received(1), pending.received(2), strict=True)
            for ((k, local_b, _), state), (_, factor) in received:
                dsts += [piece(words[group.indices[k]], local_b), piece(fresh_words[k], local_b)]
                srcs += [state, factor]
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _scatter_local(
        self, group: ShapeGroup, states: Tensor | None, factor_stack: Tensor | None
    ) -> None:
        """No traffic: each owned unit is a whole local one (``direct``). The states go back
        with one copy; each parameter's factors are a view of the owner's stack (its units
        fill consecutive slots in order: the companion's ``local_slots``)."""
        companion = group.rows
        assert companion is not None
        sched, slots = companion.schedule, companion.local_slots
        shape = group.spec.row_shape(group.local_shape)
        if sched.direct:
            assert states is not None and factor_stack is not None
            dsts = [piece(self._state(group, group.indices[k]), b) for k, b in sched.direct]
            torch._foreach_copy_(dsts, list(states.unbind(0)))
        if (
            companion.one_local_unit_each
            and factor_stack is not None
            and factor_stack.shape[1:] == shape
        ):
            # 2-D matrices: the views in one call, not one slice each.
            views = factor_stack.unbind(0)
            for k, (first, _) in enumerate(slots):
                self.factors[group.indices[k]] = views[first]
            return
        for k, (first, count) in enumerate(slots):
            i = group.indices[k]
            if count:
                self.factors[i] = factor_stack[first : first + count].view(shape)  # type: ignore[index]
            else:  # an empty local shard
                self.factors[i] = torch.empty(shape, dtype=torch.float32, device=group.device)


def row_factors(group: ShapeGroup, result: Any, states: Tensor | None) -> Tensor | None:
    """The owner's rows' factors ``(slots, rows)`` fp32 of its stack of orthogonalized matrices
    ``result`` (a tensor or one per slot), its ``states`` updated in place; None without a row
    normalization or owned units."""
    if group.rows is None or result is None:
        return None
    assert states is not None and group.path is not None
    kernel = elementwise_kernels_allowed(group.path.backend)
    if isinstance(result, Tensor):
        return normuon_factors_(result, states, group.spec, kernel)
    return torch.cat(
        [
            normuon_factors_(r[None], states[s : s + 1], group.spec, kernel)
            for s, r in enumerate(result)
        ]
    )
