"""Which rank orthogonalizes each unit: greedy largest-first load balancing (pure).

Every rank computes the same owners from the same units and holdings: units only one rank can
take go first, the others in order of decreasing estimated FLOPs, each onto the least-loaded
candidate rank. Candidates are the ranks that already hold the whole unit when there are any
(expert stacks sharded on a batch dim, ``Replicate`` meshes: no gathering at all), else every
rank of the mesh (ties go to the rank already holding the most of it).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Sequence

from muon_plugin.distributed.units import BatchIndex, GroupUnits, Holding, Holdings


class _Loads:
    """Estimated FLOPs given to each (global) rank so far, and for each order of a rank set
    (a domain's ``ranks``) a lazy heap of ``(load, linear index)``: every change pushes a
    fresh entry, and entries whose load is out of date are dropped when they surface."""

    def __init__(self) -> None:
        self.load: dict[int, float] = defaultdict(float)
        self._heaps: dict[tuple[int, ...], list[tuple[float, int]]] = {}
        self._linear: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, rank: int, flops: float) -> None:
        self.load[rank] += flops
        for ranks, heap in self._heaps.items():
            heapq.heappush(heap, (self.load[rank], self._linear[ranks][rank]))

    def least_loaded(self, ranks: tuple[int, ...]) -> tuple[float, int]:
        """``(load, j)`` of the least-loaded linear index ``j`` of ``ranks`` (ties: smallest)."""
        heap = self._heaps.get(ranks)
        if heap is None:
            heap = [(self.load[r], j) for j, r in enumerate(ranks)]
            heapq.heapify(heap)
            self._heaps[ranks] = heap
            self._linear[ranks] = {r: j for j, r in enumerate(ranks)}
        while heap[0][0] != self.load[ranks[heap[0][1]]]:
            heapq.heappop(heap)  # out of date: a fresher entry exists
        return heap[0]


def _owner(group: GroupUnits, held: list[Holding], whole: list[int], loads: _Loads) -> int:
    """The linear rank that gets a unit held as ``held``: among the ranks holding all of it
    (``whole``) when there are any, else among all ranks of the mesh, the least loaded; ties
    go to the rank holding the most of it, then to the smallest index."""
    ranks, load = group.domain.ranks, loads.load
    if whole:
        return min(whole, key=lambda j: (load[ranks[j]], j))
    best = min(((load[ranks[j]], -n, j) for j, _, n in held), default=None)
    if len(held) < len(ranks):
        # A rank holding nothing wins only if it is the least loaded of all; when the least
        # loaded rank holds a piece, ``best`` (holders first on equal load) is the answer.
        least, j = loads.least_loaded(ranks)
        if best is None or (least, 0, j) < best:
            return j
    assert best is not None
    return best[2]


def assign_owners(
    groups: Sequence[GroupUnits], holdings: Sequence[Holdings]
) -> list[tuple[int, ...]]:
    """Per group, the owner (linear rank of its domain) of each of its units.

    Units of domains over the same set of ranks are balanced together; every rank of such a set
    knows all of its units, so every rank computes the same owners. (Balancing across
    overlapping but different rank sets would need knowledge some ranks do not have.)
    """
    owners = [[-1] * len(g.units) for g in groups]
    by_ranks: dict[frozenset[int], list[int]] = defaultdict(list)
    for gi, g in enumerate(groups):
        by_ranks[frozenset(g.domain.ranks)].append(gi)
    for members in by_ranks.values():
        loads = _Loads()
        whole: dict[tuple[int, BatchIndex], list[int]] = {}
        fixed, free = [], []
        for order, gi in enumerate(members):
            g = groups[gi]
            unit_numel = math.prod(g.unit_shape)
            for b, held in holdings[gi].items():
                whole[gi, b] = [h.rank for h in held if h.numel == unit_numel]
            for ui, unit in enumerate(g.units):
                candidates = len(whole[gi, unit.index]) or g.domain.size
                (fixed if candidates == 1 else free).append((g.unit_flops, order, ui))
        free.sort(key=lambda e: (-e[0], e[1], e[2]))
        for flops, order, ui in fixed + free:
            gi = members[order]
            g = groups[gi]
            b = g.units[ui].index
            j = _owner(g, holdings[gi][b], whole[gi, b], loads)
            owners[gi][ui] = j
            loads.add(g.domain.ranks[j], flops)
    return [tuple(o) for o in owners]
