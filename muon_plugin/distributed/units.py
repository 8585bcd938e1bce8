"""A shape group's *units* (whole matrices) and which ranks hold pieces of them (pure).

A unit is a matrix orthogonalized as a whole: the last two dims of a parameter for each index
of its leading (batch) dims, or the whole parameter when its spec flattens it. Every rank of
the domain holds a piece of some units (its shard); :func:`holdings` lists those pieces per
batch index, which is what the owner choice (:mod:`~muon_plugin.distributed.owners`) and the
exchange schedule (:mod:`~muon_plugin.distributed.schedule`) are computed from.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from muon_plugin.distributed.groups import Domain
from muon_plugin.distributed.layout import Layout

BatchIndex = tuple[int, ...]


class Unit(NamedTuple):
    """One whole matrix of a shape group: its parameter (position in the group) and its index
    over the parameter's batch dims (global)."""

    param: int
    index: BatchIndex


class Holding(NamedTuple):
    """A rank's piece of the units at one batch index: the rank (linear index of the domain),
    where those units sit in its local shard (local batch index) and the piece's elements."""

    rank: int
    local_index: BatchIndex
    numel: int


Holdings = dict[BatchIndex, list[Holding]]
"""Per batch index of a group's units, the :class:`Holding` of every rank holding part of
them, ranks ascending."""


@dataclass(frozen=True, eq=False)
class GroupUnits:
    """The units of a shape group and the layout they are cut from: what the owner choice and
    the exchange schedule need to know about a group."""

    names: tuple[str, ...]
    """The group's parameters, in the step's order (for error messages)."""
    shape: tuple[int, ...]
    """Global shape of every parameter of the group."""
    domain: Domain
    layout: Layout
    unit_dims: tuple[int, ...]
    """The dims of a parameter a unit spans (the last two, or all when flattened)."""
    batch_dims: tuple[int, ...]
    """The dims indexing the units of a parameter (the others)."""
    unit_shape: tuple[int, ...]
    units: tuple[Unit, ...]
    """Parameter by parameter, each batch index in row-major order."""
    unit_flops: float
    """Estimated FLOPs of orthogonalizing one unit (the load the owners are balanced on)."""

    def unit_fields(self) -> dict[str, Any]:
        """This object's :class:`GroupUnits` fields, for a subclass built from them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GroupUnits)}


def group_units(
    names: tuple[str, ...],
    shape: tuple[int, ...],
    domain: Domain,
    layout: Layout,
    unit_dims: tuple[int, ...],
    unit_flops: float,
) -> GroupUnits:
    """The units of ``len(names)`` parameters of ``shape`` whose units span ``unit_dims``
    (none when a unit would be empty)."""
    batch_dims = tuple(d for d in range(len(shape)) if d not in unit_dims)
    unit_shape = tuple(shape[d] for d in unit_dims)
    units: tuple[Unit, ...] = ()
    if math.prod(unit_shape) != 0:
        batch = list(itertools.product(*(range(shape[d]) for d in batch_dims)))
        units = tuple(Unit(k, b) for k in range(len(names)) for b in batch)
    return GroupUnits(
        names, shape, domain, layout, unit_dims, batch_dims, unit_shape, units, unit_flops
    )


def holdings(group: GroupUnits) -> Holdings:
    """Per batch index of the group's units, the :class:`Holding` of each rank holding part
    of them, ranks ascending. Built rank by rank from the batch indices each rank holds, so it
    costs the size of its result (not units x ranks)."""
    out: Holdings = {b: [] for _, b in group.units}
    if not out:
        return out
    index = group.layout.index
    for j in range(group.domain.size):
        numel = 1
        for d in group.unit_dims:
            numel *= index[d][j].size
        if numel == 0:
            continue
        held_per_dim = [
            [(g + i, pos + i) for g, pos, n in index[d][j].local_runs() for i in range(n)]
            for d in group.batch_dims
        ]
        for combo in itertools.product(*held_per_dim):
            held = out.get(tuple(g for g, _ in combo))
            if held is not None:
                held.append(Holding(j, tuple(pos for _, pos in combo), numel))
    return out
