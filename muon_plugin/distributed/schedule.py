"""What one rank does for one shape group every step: its :class:`ExchangeSchedule` (pure).

Given a shape group's units and their owners, every distinct shard of a unit is sent once to
the owner (among replicas, the one whose coordinates on the ``Replicate`` mesh dims equal the
owner's), and the owner sends every holder (all replicas) its piece of the result: the minimum
for this owner. This module counts that traffic per rank (:class:`Traffic`: bytes on the wire,
bf16) and builds this rank's pieces to send, receive and copy locally. No process groups, no
devices: the buffer order assumes peers in linear mesh order, and the communicator re-lays a
copy (:meth:`ExchangeSchedule.lay_out`) when its process group ranks them otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from muon_plugin.distributed.layout import Layout, describe_placements
from muon_plugin.distributed.units import BatchIndex, GroupUnits, Holdings

WIRE_DTYPE = torch.bfloat16
WIRE_BYTES = 2

Slices = tuple[slice, ...]


class Rect(NamedTuple):
    """A rectangle of a rank's piece of a unit: its slices into the unit and into the piece."""

    unit: Slices
    piece: Slices


class HolderPiece(NamedTuple):
    """A holder's piece of a unit, sent to its owner or received back: the parameter (position
    in the group), the unit's local batch index in that parameter's shard, the piece's shape."""

    param: int
    local_index: BatchIndex
    shape: tuple[int, ...]


class OwnerPiece(NamedTuple):
    """A piece of an owned unit, received from a holder or sent back to it: the unit's slot in
    this rank's stack, the piece's shape and where it sits in the unit."""

    slot: int
    shape: tuple[int, ...]
    rects: tuple[Rect, ...]


class LocalPiece(NamedTuple):
    """This rank's own piece of a unit it owns: copied into its slot of the stack, and the
    result copied back."""

    slot: int
    param: int
    local_index: BatchIndex
    rects: tuple[Rect, ...]


class LocalUnit(NamedTuple):
    """A whole unit in a local shard: the parameter and the unit's local batch index."""

    param: int
    local_index: BatchIndex


# The four exchanges of a step, each keyed by peer (linear index) before it is laid out.
EXCHANGES = ("gather_send", "gather_recv", "back_send", "back_recv")

HOLDER_SIDES = ("gather_send", "back_recv")
"""The exchanges whose items are a holder's (:class:`HolderPiece`); the others carry the
owner's (:class:`OwnerPiece`)."""


@dataclass(frozen=True)
class Traffic:
    """Bytes on the wire (bf16) per linear rank of the domain in one step, per exchange."""

    gather_send_bytes: tuple[int, ...]
    gather_recv_bytes: tuple[int, ...]
    back_send_bytes: tuple[int, ...]
    back_recv_bytes: tuple[int, ...]

    @property
    def gather_comm(self) -> bool:
        """Does any rank of the domain send anything to the owners?"""
        return any(self.gather_send_bytes)

    @property
    def back_comm(self) -> bool:
        """Does any owner send results back to another rank?"""
        return any(self.back_send_bytes)

    def plus(self, other: Traffic) -> Traffic:
        """Both traffics in the same all-to-alls."""
        return Traffic(
            *(
                tuple(a + b for a, b in zip(mine, theirs, strict=True))
                for mine, theirs in zip(
                    dataclasses.astuple(self), dataclasses.astuple(other), strict=True
                )
            )
        )


@dataclass(frozen=True)
class ExchangeSchedule:
    """What this rank does for one shape group every step (built once by the planner).

    Items of the send/receive tuples are in buffer order: peers by their rank in the process
    group (linear mesh order here, see :meth:`lay_out`), then units in the group's unit order
    (sender and receiver walk the same order); ``*_splits`` are the elements per peer.
    """

    slots: tuple[int, ...]
    """The units (ids in the group's unit order) this rank orthogonalizes, in stack order."""
    gather_send: tuple[HolderPiece, ...]
    gather_send_splits: tuple[int, ...]
    gather_recv: tuple[OwnerPiece, ...]
    gather_recv_splits: tuple[int, ...]
    gather_self: tuple[LocalPiece, ...]
    back_send: tuple[OwnerPiece, ...]
    back_send_splits: tuple[int, ...]
    back_recv: tuple[HolderPiece, ...]
    back_recv_splits: tuple[int, ...]
    back_self: tuple[LocalPiece, ...]
    whole_views: dict[int, int]
    """Params whose local shard is made only of whole units this rank owns, in consecutive
    slots: their update is a view of the result stack. Param -> first slot."""
    direct: tuple[LocalUnit, ...] | None
    """When every owned unit is a whole local matrix (plain tensors, expert stacks,
    Replicate): the unit of each slot, stacked straight into bf16 by the backend."""
    by_peer: dict[str, dict[int, tuple]]
    """The four exchanges per peer (linear index), in unit order, before they are laid out."""

    def lay_out(self, order: Sequence[int]) -> ExchangeSchedule:
        """This schedule with its exchanges in buffer order for the peers (linear indices) in
        ``order``."""
        return dataclasses.replace(self, **_laid_out(self.by_peer, order))


def _laid_out(by_peer: dict[str, dict[int, tuple]], order: Sequence[int]) -> dict[str, tuple]:
    """The items and splits of each exchange with the peers in ``order``."""
    out: dict[str, tuple] = {}
    for name in EXCHANGES:
        per_peer = by_peer.get(name, {})
        items: list = []
        splits = []
        for j in order:
            peer = per_peer.get(j, ())
            items += peer
            splits.append(sum(math.prod(_piece_shape(name, item)) for item in peer))
        out[name] = tuple(items)
        out[f"{name}_splits"] = tuple(splits)
    return out


def _piece_shape(exchange: str, item: tuple) -> tuple[int, ...]:
    return item[2] if exchange in HOLDER_SIDES else item[1]


class _Builder:
    """Walks a group's units once: per-rank traffic, and this rank's schedule.

    Traffic is counted per batch index, not per (unit, holder) pair: each holder of a batch
    index sends its piece to the owner of every unit there whose ``Replicate`` coordinates
    equal its own, and receives its piece of every unit's result, except from itself. So a
    group costs O(units + holdings), not O(units x holders), at thousands of ranks; only this
    rank's own items are listed unit by unit.
    """

    def __init__(self, group: GroupUnits, owners: Sequence[int], holdings: Holdings) -> None:
        self.group, self.owners, self.holdings = group, owners, holdings
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
        self.slots: list[int] = []
        self.gather_self: list[LocalPiece] = []
        self.back_self: list[LocalPiece] = []
        self.by_peer: dict[str, dict[int, list]] = {name: defaultdict(list) for name in EXCHANGES}
        self._rects: dict[int, tuple[Rect, ...]] = {}
        self._piece_shapes: dict[int, tuple[int, ...]] = {}
        # Per batch index: numel held per rank, its sum per replica class and in all, this
        # rank's own piece, and (filled by ``unit``) the units there and their owners' classes.
        self.held = {b: {j: numel for j, _, numel in hs} for b, hs in holdings.items()}
        self.total = {b: sum(held.values()) for b, held in self.held.items()}
        self.by_replica: dict[BatchIndex, dict[tuple[int, ...], int]] = {}
        for b, hs in holdings.items():
            sums: dict[tuple[int, ...], int] = defaultdict(int)
            for j, _, numel in hs:
                sums[self.replica[j]] += numel
            self.by_replica[b] = sums
        self.mine = {b: lb for b, hs in holdings.items() for j, lb, _ in hs if j == self.me}
        self.units_at: dict[BatchIndex, int] = defaultdict(int)
        self.owner_replicas: dict[BatchIndex, dict] = defaultdict(lambda: defaultdict(int))

    def rects(self, j: int) -> tuple[Rect, ...]:
        if j not in self._rects:
            self._rects[j] = _rects(self.layout, j, self.group.unit_dims)
        return self._rects[j]

    def piece_shape(self, j: int) -> tuple[int, ...]:
        if j not in self._piece_shapes:
            index = self.layout.index
            self._piece_shapes[j] = tuple(index[d][j].size for d in self.group.unit_dims)
        return self._piece_shapes[j]

    def unit(self, u: int, k: int, b: BatchIndex) -> None:
        group, o, me = self.group, self.owners[u], self.me
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
        peers = self.by_peer
        if o == me:
            slot = len(self.slots)
            self.slots.append(u)
            for j, local_b, _ in self.holdings[b]:
                if j == o:
                    self.gather_self.append(LocalPiece(slot, k, local_b, self.rects(j)))
                    self.back_self.append(LocalPiece(slot, k, local_b, self.rects(j)))
                    continue
                item = OwnerPiece(slot, self.piece_shape(j), self.rects(j))
                if self.replica[j] == replica:
                    peers["gather_recv"][j].append(item)
                peers["back_send"][j].append(item)
        elif b in self.mine:
            item = HolderPiece(k, self.mine[b], self.piece_shape(me))
            if self.replica[me] == replica:
                peers["gather_send"][o].append(item)
            peers["back_recv"][o].append(item)

    def finish(self) -> Traffic:
        """The holders' side of the traffic, per batch index (see ``unit``): the totals."""
        traffic = self.bytes
        for b, hs in self.holdings.items():
            units, owners = self.units_at.get(b, 0), self.owner_replicas.get(b, {})
            for j, _, numel in hs:
                traffic["gather_send"][j] += numel * WIRE_BYTES * owners.get(self.replica[j], 0)
                traffic["back_recv"][j] += numel * WIRE_BYTES * units
        return Traffic(*(tuple(traffic[name]) for name in EXCHANGES))


class GroupSchedule(NamedTuple):
    """This rank's schedule for a group, and the group's traffic on every rank."""

    schedule: ExchangeSchedule
    traffic: Traffic


def schedule_units(group: GroupUnits, owners: Sequence[int], holdings: Holdings) -> GroupSchedule:
    """This rank's :class:`ExchangeSchedule` for ``group`` whose units have ``owners``, and the
    group's per-rank :class:`Traffic`."""
    builder = _Builder(group, owners, holdings)
    for u, (k, b) in enumerate(group.units):
        builder.unit(u, k, b)
    traffic = builder.finish()
    by_peer = {
        name: {j: tuple(items) for j, items in per_peer.items()}
        for name, per_peer in builder.by_peer.items()
    }
    laid = _laid_out(by_peer, range(group.domain.size))
    gather_self, back_self = tuple(builder.gather_self), tuple(builder.back_self)
    schedule = ExchangeSchedule(
        slots=tuple(builder.slots),
        gather_self=gather_self,
        back_self=back_self,
        whole_views=_whole_views(group, back_self),
        direct=_direct(group, gather_self, len(builder.slots), bool(laid["gather_recv"])),
        by_peer=by_peer,
        **laid,
    )
    return GroupSchedule(schedule, traffic)


def _rects(layout: Layout, j: int, unit_dims: tuple[int, ...]) -> tuple[Rect, ...]:
    """Rectangles of rank ``j``'s piece of a unit: (slices into the unit, slices into the piece)."""
    per_dim = [layout.index[d][j].local_runs() for d in unit_dims]
    rects = []
    for combo in itertools.product(*per_dim):
        unit_sl = tuple(slice(g, g + n) for g, _, n in combo)
        piece_sl = tuple(slice(loc, loc + n) for _, loc, n in combo)
        rects.append(Rect(unit_sl, piece_sl))
    return tuple(rects)


def _whole_views(group: GroupUnits, back_self: Sequence[LocalPiece]) -> dict[int, int]:
    """Params made only of whole units owned here, in consecutive slots: views of the result."""
    if not group.batch_dims or not math.prod(group.unit_shape):
        return {}
    local_shape = group.layout.local_shape(group.domain.me)
    my_local = math.prod(local_shape[d] for d in group.batch_dims)
    firsts: dict[int, list[int]] = defaultdict(list)
    for slot, k, _local_b, rects_ in back_self:
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


def _direct(
    group: GroupUnits, gather_self: Sequence[LocalPiece], slots: int, receives: bool
) -> tuple[LocalUnit, ...] | None:
    """The :class:`LocalUnit` of each slot when every owned unit is a whole local one."""
    if receives:
        return None
    full_rect = tuple(slice(0, n) for n in group.unit_shape)
    whole = [
        (slot, k, local_b)
        for slot, k, local_b, rects_ in gather_self
        if len(rects_) == 1 and rects_[0][0] == full_rect
    ]
    if len(whole) == len(gather_self) == slots:
        return tuple(LocalUnit(k, local_b) for _, k, local_b in sorted(whole))
    return None
