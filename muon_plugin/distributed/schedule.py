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
    """Walks a group's units once: per-rank traffic and FLOPs, and this rank's schedule.

    Traffic is counted per batch index, not per (unit, holder) pair: each holder of a batch
    index sends its piece to the owner of every unit there whose ``Replicate`` coordinates
    equal its own, and receives its piece of every unit's result, except from itself. So a
    group costs O(units + holdings), not O(units x holders), at thousands of ranks; only this
    rank's own items are listed unit by unit.
    """

    def __init__(self, group: ShapeGroup, holdings: dict[tuple[int, ...], list]) -> None:
        self.group, self.holdings = group, holdings
        self.layout, self.me = group.layout, group.domain.me
        n = group.domain.size
        self.bytes = {name: [0] * n for name in EXCHANGES}
        self.unit_numel = math.prod(group.unit_shape)
        replicate_dims = self.layout.replicate_mesh_dims
        # Each rank's coordinates on the Replicate mesh dims: a shard is sent by the replica
        # whose coordinates there equal the owner's (Layout.sender_for).
        self.replica = [
            tuple(self.layout.coordinate(j)[m] for m in replicate_dims) if replicate_dims else ()
            for j in range(n)
        ]
        self.sched = Schedule(by_peer={name: defaultdict(list) for name in EXCHANGES})
        self.slot_of: dict[int, int] = {}
        self._rects: dict[int, tuple[Rect, ...]] = {}
        self._piece_shapes: dict[int, tuple[int, ...]] = {}
        # Per batch index: numel held per rank, its sum per replica class and in all, this
        # rank's own piece, and (filled by ``unit``) the units there and their owners' classes.
        self.held = {b: {j: numel for j, _, numel in hs} for b, hs in holdings.items()}
        self.total = {b: sum(held.values()) for b, held in self.held.items()}
        self.by_replica: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
        for b, hs in holdings.items():
            sums: dict[tuple[int, ...], int] = defaultdict(int)
            for j, _, numel in hs:
                sums[self.replica[j]] += numel
            self.by_replica[b] = sums
        self.mine = {b: lb for b, hs in holdings.items() for j, lb, _ in hs if j == self.me}
        self.units_at: dict[tuple[int, ...], int] = defaultdict(int)
        self.owner_replicas: dict[tuple[int, ...], dict] = defaultdict(lambda: defaultdict(int))

    def rects(self, j: int) -> tuple[Rect, ...]:
        if j not in self._rects:
            self._rects[j] = _rects(self.layout, j, self.group.unit_dims)
        return self._rects[j]

    def piece_shape(self, j: int) -> tuple[int, ...]:
        if j not in self._piece_shapes:
            index = self.layout.index
            self._piece_shapes[j] = tuple(index[d][j].size for d in self.group.unit_dims)
        return self._piece_shapes[j]

    def unit(self, u: int, k: int, b: tuple[int, ...]) -> None:
        group, o, me = self.group, self.group.owners[u], self.me
        group.matrices_per_rank[o] += 1
        group.flops_per_rank[o] += group.unit_flops
        if o == me:
            self.slot_of[u] = len(self.sched.slots)
            self.sched.slots.append(u)
        replica = self.replica[o]
        covered = self.by_replica[b][replica]  # what the senders to this owner hold
        if covered != self.unit_numel:
            raise ValueError(
                f"internal error: shards of {group.names[k]!r} (placements "
                f"{describe_placements(self.layout.placements)}, mesh "
                f"{group.domain.mesh_shape}) cover {covered} of "
                f"{self.unit_numel} elements of a matrix"
            )
        self.units_at[b] += 1
        self.owner_replicas[b][replica] += 1
        own = self.held[b].get(o, 0)  # the owner's own piece travels nowhere
        traffic = self.bytes
        traffic["gather_recv"][o] += (covered - own) * WIRE_BYTES
        traffic["back_send"][o] += (self.total[b] - own) * WIRE_BYTES
        traffic["gather_send"][o] -= own * WIRE_BYTES  # counted for every holder in finish()
        traffic["back_recv"][o] -= own * WIRE_BYTES
        peers = self.sched.by_peer
        if o == me:
            slot = self.slot_of[u]
            for j, local_b, _ in self.holdings[b]:
                if j == o:
                    self.sched.gather_self.append((slot, k, local_b, self.rects(j)))
                    self.sched.back_self.append((slot, k, local_b, self.rects(j)))
                    continue
                item = (slot, self.piece_shape(j), self.rects(j))
                if self.replica[j] == replica:
                    peers["gather_recv"][j].append(item)
                peers["back_send"][j].append(item)
        elif b in self.mine:
            item = (k, self.mine[b], self.piece_shape(me))
            if self.replica[me] == replica:
                peers["gather_send"][o].append(item)
            peers["back_recv"][o].append(item)

    def finish(self) -> None:
        """The holders' side of the traffic, per batch index (see ``unit``)."""
        traffic = self.bytes
        for b, hs in self.holdings.items():
            units, owners = self.units_at.get(b, 0), self.owner_replicas.get(b, {})
            for j, _, numel in hs:
                traffic["gather_send"][j] += numel * WIRE_BYTES * owners.get(self.replica[j], 0)
                traffic["back_recv"][j] += numel * WIRE_BYTES * units


def schedule_group(group: ShapeGroup, holdings: dict[tuple[int, ...], list]) -> None:
    """Per-rank traffic and FLOPs of the group, and this rank's :class:`Schedule`."""
    n_ranks = group.domain.size
    group.matrices_per_rank = [0] * n_ranks
    group.flops_per_rank = [0.0] * n_ranks
    builder = _Builder(group, holdings)
    for u, (k, b) in enumerate(group.units):
        builder.unit(u, k, b)
    builder.finish()
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
