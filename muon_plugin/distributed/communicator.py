"""The communicator: process groups, wire buffers and the all-to-alls of a plan.

Created after planning, it gives every shape group with traffic a process group over exactly its
domain (:func:`~muon_plugin.distributed.groups.process_group`), lays the group's schedule out in
that group's rank order, and per step packs the local pieces into one bf16 buffer per exchange
and starts one ``all_to_all_single`` (async) for it: shards to their owners, results back.
Every rank of a domain makes the same calls in the same order, also when it has nothing to send.
``stats`` counts this rank's bytes sent/received and collective calls since :meth:`reset_stats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
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
    """One group's collective in flight, with the buffers it reads and writes."""

    work: Any
    send: Tensor
    recv: Tensor


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
        self.stats: dict[str, int] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"send_bytes": 0, "recv_bytes": 0, "collectives": 0}

    def process_group(self, group: ShapeGroup) -> ProcessGroup | None:
        """The process group of ``group``'s traffic (None when it has none)."""
        return self._groups[id(group)]

    def start_gather(self, group: ShapeGroup, directions: Sequence[Tensor]) -> InFlight | None:
        """Send this rank's shards of ``group``'s units to their owners (None: no traffic)."""
        if not group.gather_comm:
            return None
        sched = group.schedule
        send = torch.empty(sum(sched.gather_send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts = list(wire_pieces(send, (shape for _, _, shape in sched.gather_send)))
        srcs = [piece(directions[group.indices[k]], b) for k, b, _ in sched.gather_send]
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return self._all_to_all(group, send, sched.gather_recv_splits, sched.gather_send_splits)

    def start_return(self, group: ShapeGroup, result: Any) -> InFlight | None:
        """Send the holders of ``group``'s owned units their pieces of ``result``."""
        if not group.back_comm:
            return None
        sched = group.schedule
        send = torch.empty(sum(sched.back_send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts, srcs = [], []
        shapes = (shape for _, shape, _ in sched.back_send)
        for (slot, _, rects), buf in zip(sched.back_send, wire_pieces(send, shapes), strict=True):
            for unit_sl, piece_sl in rects:
                dsts.append(buf[piece_sl])
                srcs.append(result[slot][unit_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return self._all_to_all(group, send, sched.back_recv_splits, sched.back_send_splits)

    def _all_to_all(
        self, group: ShapeGroup, send: Tensor, recv_splits: list[int], send_splits: list[int]
    ) -> InFlight:
        recv = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=self.process_group(group), async_op=True
        )
        self.stats["send_bytes"] += send.numel() * WIRE_BYTES
        self.stats["recv_bytes"] += recv.numel() * WIRE_BYTES
        self.stats["collectives"] += 1
        return InFlight(work, send, recv)


def wire_pieces(buf: Tensor, shapes: Iterable[tuple[int, ...]]) -> Iterator[Tensor]:
    """Consecutive views of the flat all-to-all buffer ``buf``, one per piece shape."""
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        yield buf[offset : offset + n].view(shape)
        offset += n


def piece(t: Tensor, local_b: tuple[int, ...]) -> Tensor:
    """The matrix (unit) part of a local tensor at local batch index ``local_b``."""
    return t[local_b] if local_b else t
