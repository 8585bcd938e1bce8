"""The planner: which rank orthogonalizes which whole matrix (pure: no process groups, no I/O).

Every rank computes the same plan from the parameters' layouts:

1. Each Muon parameter is described by its global shape, its *domain* (the ranks of its device
   mesh, see :mod:`~muon_plugin.distributed.groups`) and its :class:`~muon_plugin.distributed.
   layout.Layout` (which global indices every rank of the mesh holds): a :class:`ParamLayout`.
2. Parameters are grouped into *shape groups* by (global shape, dtype, domain, placements, spec).
3. Each shape group is cut into *units*: whole matrices, i.e. the last two dims of the parameter
   for every index of its leading (batch) dims, or the whole parameter when ``spec.flatten``.
4. Every unit gets one *owner*: greedily, largest estimated FLOPs first, onto the least-loaded
   candidate rank, all shape groups of a domain together (units only one rank can take go
   first). Candidates are the ranks that already hold the whole unit when there are any (expert
   stacks sharded on a batch dim, ``Replicate`` meshes: no gathering at all), else every rank of
   the mesh (ties go to the rank already holding the most of it).
5. Traffic and this rank's schedule (:mod:`~muon_plugin.distributed.schedule`).
6. The orthogonalization path of this rank's stack, resolved once by the group's backend
   (:func:`muon_plugin.orthogonalize.resolve_path`) and stored on the group.
7. For a spec with a row normalization (NorMuon), the group's ``rows`` companion: the per-row
   state (fp32, as two bf16 words per row) laid out like the parameter's rows, with the same
   units and owners, so that each unit's rows travel to its owner with its shards and back with
   its update (:func:`row_group`).

:func:`simulated_layouts` describes hypothetical parameters (a mesh of ranks ``0 .. N-1``), so
reports and benchmarks run this same planner without processes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from muon_plugin.distributed.groups import Domain
from muon_plugin.distributed.layout import Layout, LayoutError, layout_of, row_placements
from muon_plugin.distributed.schedule import WIRE_DTYPE, Schedule, schedule_group
from muon_plugin.orthogonalize import MatrixSpec, ResolvedPath, resolve_path


@dataclass(frozen=True)
class ParamLayout:
    """One Muon parameter as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    domain: Domain
    layout: Layout
    device: torch.device
    spec: MatrixSpec


@dataclass
class ShapeGroup:
    """Parameters sharing global shape, dtype, domain, placements and spec."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: MatrixSpec
    domain: Domain
    layout: Layout
    device: torch.device
    indices: list[int] = field(default_factory=list)  # positions in the step's param list
    names: list[str] = field(default_factory=list)
    unit_dims: tuple[int, ...] = ()
    batch_dims: tuple[int, ...] = ()
    units: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (k, batch index)
    owners: list[int] = field(default_factory=list)  # linear rank of each unit's owner
    unit_flops: float = 0.0
    # Filled by the planner (per linear rank of the domain).
    matrices_per_rank: list[int] = field(default_factory=list)
    flops_per_rank: list[float] = field(default_factory=list)
    gather_send_bytes: list[int] = field(default_factory=list)
    gather_recv_bytes: list[int] = field(default_factory=list)
    back_send_bytes: list[int] = field(default_factory=list)
    back_recv_bytes: list[int] = field(default_factory=list)
    schedule: Schedule = field(default_factory=Schedule)
    gather_comm: bool = False  # does any rank of the domain send anything?
    back_comm: bool = False
    path: ResolvedPath | None = None  # how this rank orthogonalizes its stack of the group
    rows: ShapeGroup | None = None  # the per-row state's companion (NorMuon), see row_group
    # A rows companion without traffic: per parameter, (first slot, slots) of its local units
    # in this rank's stack (it owns all of them, consecutive, in order); (0, 0): none held.
    local_slots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def unit_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.unit_dims)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.layout.local_shape(self.domain.me)


MAX_LOCAL_GROUP_NUMEL = 2**25
"""Elements of one shape group of a single rank's own parameters. Larger groups are cut (whole
parameters, in order) so that a step's phases (:func:`local_phases`) hold a bounded workspace:
the bf16 directions, the stack and the iteration's temporaries of one such group at a time, not
of every matrix at once (a matrix larger than this is a group of its own). Groups whose domain
has several ranks are never cut (their units are balanced over the ranks and their traffic
batched)."""

MAX_PHASE_NUMEL = 2**26
"""Elements of the consecutive groups one phase takes together: small groups share a phase
(fewer launches), while a Llama-3-8B layer's large matrices take a phase per group."""

MAX_GRAPHED_PHASE_NUMEL = 2**27
"""Elements of consecutive CUDA-graphed groups (small matrices) one phase takes together: their
graphs overlap on side streams only within a phase, and a GPT-125M's 85 M fit in one."""


def plan_groups(params: Sequence[ParamLayout], *, batched: bool = True) -> list[ShapeGroup]:
    """Shape groups, units, owners, schedules and paths of ``params`` (in this order).

    ``batched``: this rank orthogonalizes its units of a group in one stacked call (the path is
    resolved for that stack), else unit by unit (an eager path for one unit).
    """
    plan: list[ShapeGroup] = []
    open_groups: dict[tuple, ShapeGroup] = {}  # the group a parameter of this key joins
    for i, p in enumerate(params):
        key = (p.shape, p.dtype, p.domain, p.layout.placements, p.spec)
        group = open_groups.get(key)
        if group is not None and p.domain.size == 1:
            if (len(group.indices) + 1) * math.prod(p.shape) > MAX_LOCAL_GROUP_NUMEL:
                group = None  # full: a new group of the same shape from here on
        if group is None:
            group = ShapeGroup(p.shape, p.dtype, p.spec, p.domain, p.layout, p.device)
            open_groups[key] = group
            plan.append(group)
        group.indices.append(i)
        group.names.append(p.name)
    for group in plan:
        _make_units(group)
    holdings = [_group_holdings(g) for g in plan]
    _assign_owners(plan, holdings)
    for group, held in zip(plan, holdings, strict=True):
        schedule_group(group, held)
        if group.spec.normalization is not None:
            group.rows = row_group(group)
        group.path = _resolve(group, batched)
    return plan


ROW_WORDS = 2
"""An fp32 entry of the per-row state travels as two bf16 words (its bits, unchanged)."""


def row_group(group: ShapeGroup) -> ShapeGroup:
    """The companion of ``group`` that moves its per-row state: shape ``(*rows, ROW_WORDS)``
    (the state viewed as bf16 words), placed like the parameter's rows
    (:func:`~muon_plugin.distributed.layout.row_placements`), with ``group``'s units and owners.

    Its schedule sends each unit's rows to the owner from one holder and returns the updated
    rows, and their factors, to every holder, replicas along column shards included; its
    traffic (the return's twice: states and factors) is added to ``group``'s, whose
    all-to-alls carry it.
    """
    rows_shape = group.spec.row_shape(group.shape)
    shape = (*rows_shape, ROW_WORDS)
    placements = row_placements(group.layout.placements, len(rows_shape))
    layout = layout_of(shape, group.domain.mesh_shape, placements)
    rows = ShapeGroup(shape, WIRE_DTYPE, group.spec, group.domain, layout, group.device)
    rows.indices, rows.names = group.indices, group.names
    rows.unit_dims = (len(shape) - 2, len(shape) - 1)
    rows.batch_dims = tuple(range(len(shape) - 2))
    rows.units, rows.owners = group.units, group.owners
    schedule_group(rows, _group_holdings(rows))
    rows.back_send_bytes = [2 * n for n in rows.back_send_bytes]  # states and factors
    rows.back_recv_bytes = [2 * n for n in rows.back_recv_bytes]
    for name in ("gather_send_bytes", "gather_recv_bytes", "back_send_bytes", "back_recv_bytes"):
        total = [a + b for a, b in zip(getattr(group, name), getattr(rows, name), strict=True)]
        setattr(group, name, total)
    group.gather_comm = group.gather_comm or rows.gather_comm
    group.back_comm = group.back_comm or rows.back_comm
    if not (rows.gather_comm or rows.back_comm):
        rows.local_slots = _local_slots(rows)
    return rows


def _local_slots(rows: ShapeGroup) -> list[tuple[int, int]]:
    """``(first slot, slots)`` per parameter of a companion whose units are all owned where
    they are held: unit order keeps each parameter's local units consecutive and in order."""
    direct = rows.schedule.direct
    if direct is None:
        raise ValueError(f"internal error: the rows of {rows.names[0]!r} need traffic")
    taken: list[list[int]] = [[] for _ in rows.indices]
    for slot, (k, _) in enumerate(direct):
        taken[k].append(slot)
    out = []
    for k, slots in enumerate(taken):
        if slots and slots != list(range(slots[0], slots[0] + len(slots))):
            raise ValueError(f"internal error: the rows of {rows.names[k]!r} are not consecutive")
        out.append((slots[0], len(slots)) if slots else (0, 0))
    return out


def local_phases(groups: Sequence[ShapeGroup]) -> list[list[ShapeGroup]]:
    """The groups cut into phases that a step may run one after another, momentum to update:
    consecutive groups of at most :data:`MAX_PHASE_NUMEL` elements together, or of at most
    :data:`MAX_GRAPHED_PHASE_NUMEL` where every one of them is replayed through a CUDA graph
    (one group alone may exceed either). Where any group communicates, one phase holds them
    all, so that every rank runs the same collectives in the same order and gathers overlap
    compute."""
    if any(g.gather_comm or g.back_comm for g in groups):
        return [list(groups)] if groups else []
    phases: list[list[ShapeGroup]] = []
    total, all_graphed = 0, True
    for group in groups:
        numel = len(group.indices) * math.prod(group.shape)
        graphed = group.path is not None and group.path.graph
        limit = MAX_GRAPHED_PHASE_NUMEL if graphed and all_graphed else MAX_PHASE_NUMEL
        if not phases or total + numel > limit:
            phases.append([])
            total, all_graphed = 0, True
        phases[-1].append(group)
        total += numel
        all_graphed = all_graphed and graphed
    return phases


def simulated_layouts(
    entries: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...], MatrixSpec]],
    *,
    rank: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[ParamLayout]:
    """Hypothetical parameters ``(global shape, mesh shape, placements, spec)``, as seen by
    ``rank``; every mesh spans ranks ``0 .. N-1`` in row-major order."""
    out = []
    for i, (shape, mesh_shape, placements, spec) in enumerate(entries):
        shape, mesh_shape = tuple(shape), tuple(mesh_shape)
        try:
            layout = layout_of(shape, mesh_shape, tuple(placements))
        except LayoutError as e:
            raise ValueError(f"cannot orthogonalize entry #{i} (shape {shape}): {e}") from None
        domain = Domain(tuple(range(math.prod(mesh_shape))), mesh_shape, rank, None)
        out.append(ParamLayout(f"#{i}", shape, dtype, domain, layout, torch.device(device), spec))
    return out


def _resolve(group: ShapeGroup, batched: bool) -> ResolvedPath:
    """This rank's path for the group: its whole stack (batched) or one unit at a time."""
    stack = len(group.schedule.slots) if batched else 1
    return resolve_path(group.unit_shape, stack, group.device, group.dtype, group.spec, batched)


def _make_units(group: ShapeGroup) -> None:
    ndim = len(group.shape)
    if group.spec.flatten:
        group.unit_dims, group.batch_dims = tuple(range(ndim)), ()
    else:
        group.unit_dims, group.batch_dims = (ndim - 2, ndim - 1), tuple(range(ndim - 2))
    group.unit_flops = group.spec.flops(group.unit_shape)
    if math.prod(group.unit_shape) == 0:
        group.units = []
        return
    batch = list(itertools.product(*(range(group.shape[d]) for d in group.batch_dims)))
    group.units = [(k, b) for k in range(len(group.indices)) for b in batch]


def _group_holdings(group: ShapeGroup) -> dict[tuple[int, ...], list]:
    """Per batch index of the group's units, ``(linear rank, local batch index, piece numel)``
    of each rank holding part of that unit, ranks ascending. Built rank by rank from the batch
    indices each rank holds, so it costs the size of its result (not units x ranks)."""
    out: dict[tuple[int, ...], list] = {b: [] for _, b in group.units}
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
                held.append((j, tuple(pos for _, pos in combo), numel))
    return out


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


def _owner(group: ShapeGroup, held: list, whole: list[int], loads: _Loads) -> int:
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


def _assign_owners(groups: list[ShapeGroup], holdings: list[dict]) -> None:
    """Greedy largest-first load balancing of units onto ranks, per set of ranks.

    Units of domains over the same set of ranks are balanced together; every rank of such a set
    knows all of its units, so every rank computes the same owners. (Balancing across
    overlapping but different rank sets would need knowledge some ranks do not have.) Units
    only one rank can take go first; the others in order of decreasing FLOPs.
    """
    by_ranks: dict[frozenset[int], list[int]] = defaultdict(list)
    for gi, g in enumerate(groups):
        by_ranks[frozenset(g.domain.ranks)].append(gi)
    for members in by_ranks.values():
        loads = _Loads()
        whole: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        fixed, free = [], []
        for order, gi in enumerate(members):
            g = groups[gi]
            g.owners = [-1] * len(g.units)
            unit_numel = math.prod(g.unit_shape)
            for b, held in holdings[gi].items():
                whole[gi, b] = [j for j, _, n in held if n == unit_numel]
            for ui, (_, b) in enumerate(g.units):
                candidates = len(whole[gi, b]) or g.domain.size
                (fixed if candidates == 1 else free).append((g.unit_flops, order, ui))
        free.sort(key=lambda e: (-e[0], e[1], e[2]))
        for flops, order, ui in fixed + free:
            gi = members[order]
            g = groups[gi]
            b = g.units[ui][1]
            j = _owner(g, holdings[gi][b], whole[gi, b], loads)
            g.owners[ui] = j
            loads.add(g.domain.ranks[j], flops)
