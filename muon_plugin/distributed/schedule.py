"""What one rank does for one shape group every step: its :class:`Schedule` (pure planning).

Given a shape group's units and their owners, every distinct shard of a unit is sent once to
the owner (among replicas, the one whose coordinates on the ``Replicate`` mesh dims equal the
owner's), and the owner sends every holder (all replicas) its piece of the result: the minimum
for this owner. This module counts that traffic per rank (bytes on the wire, bf16) and builds
this rank's lists of pieces to send, receive and copy locally. No process groups, no devices:
the buffer order assumes peers in linear mesh order, and the communicator re-lays it
(:meth:`Schedule.lay_out`) when its process group ranks them otherwise.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from muon_plugin.distributed.layout import Layout, describe_placements

if TYPE_CHECKING:
    from muon_plugin.distributed.planner import ShapeGroup

WIRE_DTYPE = torch.bfloat16
WIRE_BYTES = 2

Slices = tuple[slice, ...]
Rect = tuple[Slices, Slices]  # (slices into the unit, slices into the piece)
# The four exchanges of a step, each keyed by peer (linear index) before it is laid out.
EXCHANGES = ("gather_send", "gather_recv", "back_send", "back_recv")


@dataclass
class Schedule:
    """What this rank does for one shape group every step (built once by the planner).

    Items of the send/receive lists are in buffer order: peers by their rank in the process
    group, then units in the group's unit order (sender and receiver walk the same order).
    """

    slots: list[int] = field(default_factory=list)  # unit ids this rank orthogonalizes
    # Gather: (param k, local batch index, piece shape) sent; (slot, piece shape, rects) received.
    gather_send: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    gather_recv: list[tuple[int, tuple[int, ...], tuple[Rect, ...]]] = field(default_factory=list)
    gather_self: list[tuple[int, int, tuple[int, ...], tuple[Rect, ...]]] = field(
        default_factory=list
    )
    gather_send_splits: list[int] = field(default_factory=list)
    gather_recv_splits: list[int] = field(default_factory=list)
    # Return: (slot, piece shape, rects) sent; (param k, local batch index, piece shape) received.
    back_send: list[tuple[int, tuple[int, ...], tuple[Rect, ...]]] = field(default_factory=list)
    back_recv: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    back_self: list[tuple[int, int, tuple[int, ...], tuple[Rect, ...]]] = field(
        default_factory=list
    )
    back_send_splits: list[int] = field(default_factory=list)
    back_recv_splits: list[int] = field(default_factory=list)
    # Params whose local shard is made only of whole units this rank owns, in consecutive slots:
    # their update is a view of the result stack. k -> first slot.
    whole_views: dict[int, int] = field(default_factory=dict)
    # When every owned unit is a whole local matrix (plain tensors, expert stacks, Replicate):
    # (param k, local batch index) per slot, stacked straight into bf16 by the backend.
    direct: list[tuple[int, tuple[int, ...]]] | None = None
    # The exchanges per peer (linear index), in unit order, before they are laid out.
    by_peer: dict[str, dict[int, list]] = field(default_factory=dict)

    def lay_out(self, order: Sequence[int]) -> None:
        """Lay the exchanges into buffer order: the peers (linear indices) in ``order``."""
        for name in EXCHANGES:
            per_peer = self.by_peer.get(name, {})
            items, splits = [], []
            for j in order:
                peer = per_peer.get(j, [])
                items += peer
                splits.append(sum(math.prod(_piece_shape(name, item)) for item in peer))
            setattr(self, name, items)
            setattr(self, f"{name}_splits", splits)


HOLDER_SIDES = ("gather_send", "back_recv")
"""The exchanges whose items are a holder's: ``(param k, local batch index, piece shape)``; the
others carry the owner's ``(slot, piece shape, rects)``."""


def _piece_shape(exchange: str, item: tuple) -> tuple[int, ...]:
    return item[2] if exchange in HOLDER_SIDES else item[1]


class _Builder:
    """Walks a group's units once: per-rank traffic and FLOPs, and this rank's schedule."""

    def __init__(self, group: ShapeGroup, holdings: dict[tuple[int, ...], list]) -> None:
        self.group, self.holdings = group, holdings
        self.layout, self.me = group.layout, group.domain.me
        n = group.domain.size
        self.bytes = {name: [0] * n for name in EXCHANGES}
        self.piece_shape = {
            j: tuple(self.layout.index[d][j].size for d in group.unit_dims) for j in range(n)
        }
        self.sched = Schedule(by_peer={name: defaultdict(list) for name in EXCHANGES})
        self.slot_of: dict[int, int] = {}
        self._rects: dict[int, tuple[Rect, ...]] = {}

    def rects(self, j: int) -> tuple[Rect, ...]:
        if j not in self._rects:
            self._rects[j] = _rects(self.layout, j, self.group.unit_dims)
        return self._rects[j]

    def unit(self, u: int, k: int, b: tuple[int, ...]) -> None:
        group, o = self.group, self.group.owners[u]
        group.matrices_per_rank[o] += 1
        group.flops_per_rank[o] += group.unit_flops
        if o == self.me:
            self.slot_of[u] = len(self.sched.slots)
            self.sched.slots.append(u)
        covered = 0
        for j, local_b, numel in self.holdings[b]:
            if self.layout.sender_for(j, o) == j:  # one replica of each shard sends it
                covered += numel
                self.gather(u, k, j, o, local_b, numel)
            self.back(u, k, j, o, local_b, numel)
        if covered != math.prod(group.unit_shape):
            raise ValueError(
                f"internal error: shards of {group.names[k]!r} (placements "
                f"{describe_placements(self.layout.placements)}, mesh "
                f"{group.domain.mesh_shape}) cover {covered} of "
                f"{math.prod(group.unit_shape)} elements of a matrix"
            )

    def gather(self, u: int, k: int, j: int, o: int, local_b: tuple, numel: int) -> None:
        """Holder ``j``'s piece of unit ``u`` travels to its owner ``o``."""
        self.exchange("gather_send", "gather_recv", self.sched.gather_self, u, k, j, o, local_b,
                      numel)  # fmt: skip

    def back(self, u: int, k: int, j: int, o: int, local_b: tuple, numel: int) -> None:
        """The owner ``o`` returns holder ``j``'s piece of unit ``u``'s result."""
        self.exchange("back_recv", "back_send", self.sched.back_self, u, k, j, o, local_b, numel)

    def exchange(
        self,
        holder_side: str,
        owner_side: str,
        on_self: list,
        u: int,
        k: int,
        j: int,
        o: int,
        local_b: tuple,
        numel: int,
    ) -> None:
        """One piece between holder ``j`` and owner ``o``: a local copy when they are the same
        rank, else the bytes of both sides and, on this rank, the item of its side
        (``(k, local batch index, piece shape)`` for the holder, ``(slot, piece shape, rects)``
        for the owner)."""
        if j == o:
            if o == self.me:
                on_self.append((self.slot_of[u], k, local_b, self.rects(j)))
            return
        self.bytes[holder_side][j] += numel * WIRE_BYTES
        self.bytes[owner_side][o] += numel * WIRE_BYTES
        peers = self.sched.by_peer
        if j == self.me:
            peers[holder_side][o].append((k, local_b, self.piece_shape[j]))
        if o == self.me:
            peers[owner_side][j].append((self.slot_of[u], self.piece_shape[j], self.rects(j)))


def schedule_group(group: ShapeGroup, holdings: dict[tuple[int, ...], list]) -> None:
    """Per-rank traffic and FLOPs of the group, and this rank's :class:`Schedule`."""
    n_ranks = group.domain.size
    group.matrices_per_rank = [0] * n_ranks
    group.flops_per_rank = [0.0] * n_ranks
    builder = _Builder(group, holdings)
    for u, (k, b) in enumerate(group.units):
        builder.unit(u, k, b)
    traffic = builder.bytes
    group.gather_send_bytes, group.gather_recv_bytes = (
        traffic["gather_send"],
        traffic["gather_recv"],
    )
    group.back_send_bytes, group.back_recv_bytes = traffic["back_send"], traffic["back_recv"]
    group.gather_comm = any(group.gather_send_bytes)
    group.back_comm = any(group.back_send_bytes)
    sched = builder.sched
    sched.lay_out(range(n_ranks))
    sched.whole_views = _whole_views(group, sched)
    sched.direct = _direct(group, sched)
    group.schedule = sched


def _rects(layout: Layout, j: int, unit_dims: tuple[int, ...]) -> tuple[Rect, ...]:
    """Rectangles of rank ``j``'s piece of a unit: (slices into the unit, slices into the piece)."""
    per_dim = [layout.index[d][j].local_runs() for d in unit_dims]
    rects = []
    for combo in itertools.product(*per_dim):
        unit_sl = tuple(slice(g, g + n) for g, _, n in combo)
        piece_sl = tuple(slice(loc, loc + n) for _, loc, n in combo)
        rects.append((unit_sl, piece_sl))
    return tuple(rects)


def _whole_views(group: ShapeGroup, sched: Schedule) -> dict[int, int]:
    """Params made only of whole units owned here, in consecutive slots: views of the result."""
    if not group.batch_dims or not math.prod(group.unit_shape):
        return {}
    my_local = math.prod(group.local_shape[d] for d in group.batch_dims)
    firsts: dict[int, list[int]] = defaultdict(list)
    for slot, k, _local_b, rects_ in sched.back_self:
        unit_sl, _ = rects_[0]
        whole = len(rects_) == 1 and all(
            s.stop - s.start == n for s, n in zip(unit_sl, group.unit_shape, strict=True)
        )
        firsts[k].append(slot if whole else -1)
    views = {}
    for k, slots in firsts.items():
        consecutive = slots[0] >= 0 and slots == list(range(slots[0], slots[0] + my_local))
        if len(slots) == my_local and consecutive:
            views[k] = slots[0]
    return views


def _direct(group: ShapeGroup, sched: Schedule) -> list[tuple[int, tuple[int, ...]]] | None:
    """``(param k, local batch index)`` per slot when every owned unit is a whole local one."""
    if sched.gather_recv:
        return None
    full_rect = tuple(slice(0, n) for n in group.unit_shape)
    whole = [
        (slot, k, local_b)
        for slot, k, local_b, rects_ in sched.gather_self
        if len(rects_) == 1 and rects_[0][0] == full_rect
    ]
    if len(whole) == len(sched.gather_self) == len(sched.slots):
        return [(k, local_b) for _, k, local_b in sorted(whole)]
    return None
