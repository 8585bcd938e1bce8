"""The communicator: process groups, wire buffers and the all-to-alls of a plan.

Created after planning, it gives every shape group with traffic a process group over exactly its
domain (:func:`~muon_plugin.distributed.groups.process_group`), lays the group's schedule out in
that group's rank order, and per step packs the local pieces into one bf16 buffer per exchange
and starts one ``all_to_all_single`` (async) for it: shards to their owners, results back.
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
from muon_plugin.distributed.schedule import WIRE_BYTES, WIRE_DTYPE


@dataclass
class InFlight:
    """One group's collective in flight, with the buffers it reads and writes.

    ``recv_parts``: per part of each peer's segment, the elements it takes per peer and where
    it starts (:func:`packed_splits`)."""

    work: Any
    send: Tensor
    recv: Tensor
    recv_parts: list[tuple[list[int], list[int]]]

    def pieces(self, part: int, shapes: Iterable[tuple[int, ...]]) -> Iterator[Tensor]:
        """Views of the received buffer, one per piece shape of ``part``, in buffer order."""
        splits, starts = self.recv_parts[part]
        return part_pieces(self.recv, shapes, splits, starts)


class Communicator:
    """The process groups of ``groups`` (created here) and their per-step exchanges."""

    def __init__(self, groups: Sequence[ShapeGroup]) -> None:
        self._groups: dict[int, ProcessGroup | None] = {}
        for group in groups:
            pg = process_group(group.domain) if group.gather_comm or group.back_comm else None
            self._groups[id(group)] = pg
            # Buffers are laid out by rank inside the process group.
            group_rank = group_ranks_of(group.domain, pg)
            order = sorted(range(group.domain.size), key=lambda j: group_rank[j])
            if order != list(range(group.domain.size)):
                group.schedule.lay_out(order)
                if group.rows is not None:
                    group.rows.schedule.lay_out(order)
        self.stats: dict[str, int] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"send_bytes": 0, "recv_bytes": 0, "collectives": 0}

    def process_group(self, group: ShapeGroup) -> ProcessGroup | None:
        """The process group of ``group``'s traffic (None when it has none)."""
        return self._groups[id(group)]

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
        sched = group.schedule
        parts = [(sched.gather_send_splits, sched.gather_recv_splits)]
        items = [
            (
                [shape for _, _, shape in sched.gather_send],
                [piece(directions[group.indices[k]], b) for k, b, _ in sched.gather_send],
            )
        ]
        if group.rows is not None:
            rsched = _rows_schedule(group, rows)
            parts.append((rsched.gather_send_splits, rsched.gather_recv_splits))
            items.append(
                (
                    [shape for _, _, shape in rsched.gather_send],
                    [piece(rows[group.indices[k]], b) for k, b, _ in rsched.gather_send],  # type: ignore[index]
                )
            )
        send_splits, send_starts = packed_splits([p[0] for p in parts])
        send = torch.empty(sum(send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts, srcs = [], []
        for (shapes, sources), (splits, _), starts in zip(items, parts, send_starts, strict=True):
            dsts += part_pieces(send, shapes, splits, starts)
            srcs += sources
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return self._all_to_all(group, send, send_splits, [p[1] for p in parts])

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
        sched = group.schedule
        exchanges = [(sched.back_send, sched.back_send_splits, sched.back_recv_splits, result)]
        if group.rows is not None:
            rsched = group.rows.schedule
            for stack in (rows_result, factors):
                exchanges.append(
                    (rsched.back_send, rsched.back_send_splits, rsched.back_recv_splits, stack)
                )
        send_splits, send_starts = packed_splits([e[1] for e in exchanges])
        send = torch.empty(sum(send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts, srcs = [], []
        for (items, splits, _, stack), starts in zip(exchanges, send_starts, strict=True):
            shapes = (shape for _, shape, _ in items)
            bufs = part_pieces(send, shapes, splits, starts)
            for (slot, _, rects), buf in zip(items, bufs, strict=True):
                for unit_sl, piece_sl in rects:
                    dsts.append(buf[piece_sl])
                    srcs.append(stack[slot][unit_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return self._all_to_all(group, send, send_splits, [e[2] for e in exchanges])

    def _all_to_all(
        self,
        group: ShapeGroup,
        send: Tensor,
        send_splits: list[int],
        recv_parts: list[list[int]],
    ) -> InFlight:
        recv_splits, recv_starts = packed_splits(recv_parts)
        recv = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=self.process_group(group), async_op=True
        )
        self.stats["send_bytes"] += send.numel() * WIRE_BYTES
        self.stats["recv_bytes"] += recv.numel() * WIRE_BYTES
        self.stats["collectives"] += 1
        return InFlight(work, send, recv, list(zip(recv_parts, recv_starts, strict=True)))


def _rows_schedule(group: ShapeGroup, rows: Mapping[int, Tensor] | None) -> Any:
    if rows is None:
        raise ValueError(
            f"{group.names[0]!r}: its group normalizes rows, but no per-row state was given"
        )
    assert group.rows is not None
    return group.rows.schedule


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
