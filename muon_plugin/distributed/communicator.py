"""The communicator: process groups, wire buffers and the all-to-alls of a plan.

Created after planning, it gives every shape group with traffic a process group over exactly its
domain (:func:`~muon_plugin.distributed.groups.process_group`), keeps the group's schedule laid
out in that group's rank order (a copy where it differs from the plan's linear mesh order: the
plan itself is never changed), and per step packs the local pieces into one bf16 buffer per
exchange and starts one ``all_to_all_single`` (async) for it: shards to their owners, results
back. The :class:`InFlight` it returns hands out the received pieces with what each one is.
A group with a ``rows`` companion (NorMuon's per-row state) carries the rows in the same
buffers: each peer's segment holds the group's pieces, then the rows' pieces (*parts* 0 and 1),
and on the way back also the rows' factors (part 2).
Every rank of a domain makes the same calls in the same order, also when it has nothing to send.
``stats`` counts this rank's bytes sent/received and collective calls since :meth:`reset_stats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from muon_plugin.distributed.groups import group_ranks_of, process_group
from muon_plugin.distributed.planner import ShapeGroup
from muon_plugin.distributed.schedule import (
    WIRE_BYTES,
    WIRE_DTYPE,
    ExchangeSchedule,
    HolderPiece,
    OwnerPiece,
)

Piece = HolderPiece | OwnerPiece


@dataclass
class InFlight:
    """One group's collective in flight, with the buffers it reads and writes.

    ``received_parts``: per part of each peer's segment, the pieces it brings (buffer order),
    the elements it takes per peer and where it starts (:func:`packed_splits`)."""

    work: Any
    send: Tensor
    recv: Tensor
    received_parts: list[tuple[tuple[Piece, ...], Sequence[int], list[int]]]

    def received(self, part: int) -> Iterator[tuple[Any, Tensor]]:
        """Each piece of ``part`` with its view of the received buffer, in buffer order."""
        items, splits, starts = self.received_parts[part]
        shapes = (item.shape for item in items)
        return zip(items, part_pieces(self.recv, shapes, splits, starts), strict=True)


@dataclass(frozen=True)
class _Link:
    """One shape group's traffic on this rank: its process group and its schedules (and its
    rows companion's) in that group's rank order."""

    group: ProcessGroup | None
    schedule: ExchangeSchedule
    rows: ExchangeSchedule | None


class Communicator:
    """The process groups of ``groups`` (created here) and their per-step exchanges."""

    def __init__(self, groups: Sequence[ShapeGroup]) -> None:
        self._links: dict[int, _Link] = {}
        for group in groups:
            pg = process_group(group.domain) if group.gather_comm or group.back_comm else None
            # Buffers are laid out by rank inside the process group.
            group_rank = group_ranks_of(group.domain, pg)
            order = sorted(range(group.domain.size), key=lambda j: group_rank[j])
            schedule = group.schedule
            rows = None if group.rows is None else group.rows.schedule
            if order != list(range(group.domain.size)):
                schedule = schedule.lay_out(order)
                rows = None if rows is None else rows.lay_out(order)
            self._links[id(group)] = _Link(pg, schedule, rows)
        self.stats: dict[str, int] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"send_bytes": 0, "recv_bytes": 0, "collectives": 0}

    def process_group(self, group: ShapeGroup) -> ProcessGroup | None:
        """The process group of ``group``'s traffic (None when it has none)."""
        return self._links[id(group)].group

    def start_gather(
        self,
        group: ShapeGroup,
        directions: Sequence[Tensor],
        rows: Mapping[int, Tensor] | None = None,
    ) -> InFlight | None:
        """Send this rank's shards of ``group``'s units to their owners (None: no traffic);
        with ``group.rows``, each unit's per-row state too (``rows``: by parameter position, its
        local state as bf16 words ``(..., rows, ROW_WORDS)``)."""
        if not group.gather_comm:
            return None
        link = self._links[id(group)]
        parts = [(link.schedule, directions)]
        if group.rows is not None:
            parts.append((_rows_schedule(group, link, rows), rows))  # type: ignore[arg-type]
        send_splits, send_starts = packed_splits([s.gather_send_splits for s, _ in parts])
        send = torch.empty(sum(send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts, srcs = [], []
        for (sched, sources), starts in zip(parts, send_starts, strict=True):
            shapes = [shape for _, _, shape in sched.gather_send]
            dsts += part_pieces(send, shapes, sched.gather_send_splits, starts)
            srcs += [piece(sources[group.indices[k]], b) for k, b, _ in sched.gather_send]
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        received = [(s.gather_recv_splits, s.gather_recv) for s, _ in parts]
        return self._all_to_all(link, send, send_splits, received)

    def start_return(
        self,
        group: ShapeGroup,
        result: Any,
        rows_result: Tensor | None = None,
        factors: Tensor | None = None,
    ) -> InFlight | None:
        """Send the holders of ``group``'s owned units their pieces of ``result`` (and, with
        ``group.rows``, of the updated per-row states ``rows_result`` and of the rows' factors
        ``factors``: the owner's stacks, as bf16 words; parts 1 and 2)."""
        if not group.back_comm:
            return None
        link = self._links[id(group)]
        parts = [(link.schedule, result)]
        if link.rows is not None:
            parts += [(link.rows, rows_result), (link.rows, factors)]
        send_splits, send_starts = packed_splits([s.back_send_splits for s, _ in parts])
        send = torch.empty(sum(send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts, srcs = [], []
        for (sched, stack), starts in zip(parts, send_starts, strict=True):
            shapes = (shape for _, shape, _ in sched.back_send)
            bufs = part_pieces(send, shapes, sched.back_send_splits, starts)
            for (slot, _, rects), buf in zip(sched.back_send, bufs, strict=True):
                for unit_sl, piece_sl in rects:
                    dsts.append(buf[piece_sl])
                    srcs.append(stack[slot][unit_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        received = [(s.back_recv_splits, s.back_recv) for s, _ in parts]
        return self._all_to_all(link, send, send_splits, received)

    def _all_to_all(
        self,
        link: _Link,
        send: Tensor,
        send_splits: list[int],
        recv_parts: list[tuple[Sequence[int], tuple[Piece, ...]]],
    ) -> InFlight:
        recv_splits, recv_starts = packed_splits([splits for splits, _ in recv_parts])
        recv = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=link.group, async_op=True
        )
        self.stats["send_bytes"] += send.numel() * WIRE_BYTES
        self.stats["recv_bytes"] += recv.numel() * WIRE_BYTES
        self.stats["collectives"] += 1
        received = [
            (items, splits, starts)
            for (splits, items), starts in zip(recv_parts, recv_starts, strict=True)
        ]
        return InFlight(work, send, recv, received)


def _rows_schedule(
    group: ShapeGroup, link: _Link, rows: Mapping[int, Tensor] | None
) -> ExchangeSchedule:
    if rows is None:
        raise ValueError(
            f"{group.names[0]!r}: its group normalizes rows, but no per-row state was given"
        )
    assert link.rows is not None
    return link.rows


def packed_splits(parts: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """A buffer whose segment for each peer holds ``parts`` one after another (``parts[i][j]``
    elements of part ``i`` for peer ``j``): the elements per peer, and where each part starts
    in each peer's segment."""
    peers = len(parts[0])
    splits = [sum(part[j] for part in parts) for j in range(peers)]
    segment = [0] * peers
    for j in range(1, peers):
        segment[j] = segment[j - 1] + splits[j - 1]
    starts = []
    for i in range(len(parts)):
        starts.append([segment[j] + sum(parts[k][j] for k in range(i)) for j in range(peers)])
    return splits, starts


def part_pieces(
    buf: Tensor, shapes: Iterable[tuple[int, ...]], splits: Sequence[int], starts: Sequence[int]
) -> Iterator[Tensor]:
    """Views of ``buf``, one per piece shape: consecutive pieces of one part, ``splits[j]``
    elements of them from ``starts[j]`` for each peer ``j`` in turn."""
    shapes = iter(shapes)
    for n, start in zip(splits, starts, strict=True):
        offset, end = start, start + n
        while offset < end:
            shape = next(shapes)
            size = math.prod(shape)
            yield buf[offset : offset + size].view(shape)
            offset += size


def piece(t: Tensor, local_b: tuple[int, ...]) -> Tensor:
    """The matrix (unit) part of a local tensor at local batch index ``local_b``."""
    return t[local_b] if local_b else t
