"""The planner: which rank orthogonalizes which whole matrix (pure: no process groups, no I/O).

Every rank computes the same plan from the parameters' layouts, once, as immutable
:class:`ShapeGroup` objects that the communicator and the executor only read:

1. Each Muon parameter is described by its global shape, its *domain* (the ranks of its device
   mesh, see :mod:`~muon_plugin.distributed.groups`) and its :class:`~muon_plugin.distributed.
   layout.Layout` (which global indices every rank of the mesh holds): a :class:`ParamLayout`.
2. Parameters are grouped into *shape groups* by (global shape, dtype, domain, placements, spec).
3. Each shape group is cut into *units* (:mod:`~muon_plugin.distributed.units`): whole
   matrices, i.e. the last two dims of the parameter for every index of its leading (batch)
   dims, or the whole parameter when ``spec.flatten``.
4. Every unit gets one *owner* (:mod:`~muon_plugin.distributed.owners`): greedily, largest
   estimated FLOPs first, onto the least-loaded candidate rank, all shape groups of a domain
   together.
5. Per-rank matrices and FLOPs, traffic, and this rank's exchange schedule
   (:mod:`~muon_plugin.distributed.schedule`).
6. For a spec with a row normalization (NorMuon), the group's ``rows`` companion
   (:class:`RowGroup`): the per-row state (fp32, as two bf16 words per row) laid out like the
   parameter's rows, with the same units and owners, so that each unit's rows travel to its
   owner with its shards and back with its update; its traffic is added to the group's.
7. The orthogonalization path of this rank's stack, resolved once by the group's backend
   (:func:`muon_plugin.orthogonalize.resolve_path`).

:func:`simulated_layouts` describes hypothetical parameters (a mesh of ranks ``0 .. N-1``), so
reports and benchmarks run this same planner without processes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from muon_plugin.distributed.groups import Domain
from muon_plugin.distributed.layout import Layout, LayoutError, layout_of, row_placements
from muon_plugin.distributed.owners import assign_owners
from muon_plugin.distributed.schedule import ExchangeSchedule, Traffic, schedule_units
from muon_plugin.distributed.units import GroupUnits, Holdings, group_units, holdings
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


class SlotRange(NamedTuple):
    """Consecutive slots of a stack: the first and how many."""

    first: int
    count: int


@dataclass(frozen=True, eq=False)
class RowGroup(GroupUnits):
    """The companion of a shape group that moves its per-row state (NorMuon): shape
    ``(*rows, ROW_WORDS)`` (the state viewed as bf16 words), placed like the parameter's rows
    (:func:`~muon_plugin.distributed.layout.row_placements`), with the group's units and owners.

    Its schedule sends each unit's rows to the owner from one holder and returns the updated
    rows, and their factors, to every holder, replicas along column shards included (its
    return bytes count both); the group's all-to-alls carry them.
    """

    schedule: ExchangeSchedule
    traffic: Traffic
    gather_comm: bool
    back_comm: bool
    local_slots: tuple[SlotRange, ...]
    """Without traffic: per parameter, the slots of its local units in this rank's stack (it
    owns all of them, consecutive, in order); ``(0, 0)``: none held."""

    @property
    def travels(self) -> bool:
        """Whether any rank sends or receives these rows (else all of them are local)."""
        return self.gather_comm or self.back_comm

    @functools.cached_property
    def one_local_unit_each(self) -> bool:
        """Whether every parameter holds exactly one local unit (``local_slots``): its rows'
        factors are then one slot of the owner's stack (derived once, read every step)."""
        return all(count == 1 for _, count in self.local_slots)


@dataclass(frozen=True, eq=False)
class ShapeGroup(GroupUnits):
    """The plan of one shape group: parameters sharing global shape, dtype, domain, placements
    and spec; their units and owners, per-rank load and traffic, this rank's schedule and path.
    Built once by :func:`plan_groups`, never changed."""

    dtype: torch.dtype
    spec: MatrixSpec
    device: torch.device
    indices: tuple[int, ...]
    """The parameters' positions in the step's parameter list."""
    owners: tuple[int, ...]
    """The linear rank of each unit's owner."""
    matrices_per_rank: tuple[int, ...]
    flops_per_rank: tuple[float, ...]
    gather_send_bytes: tuple[int, ...]
    """Per linear rank, in one step (a ``rows`` companion's included, as every byte below)."""
    gather_recv_bytes: tuple[int, ...]
    back_send_bytes: tuple[int, ...]
    back_recv_bytes: tuple[int, ...]
    gather_comm: bool
    """Does any rank of the domain send anything to the owners?"""
    back_comm: bool
    """Does any owner send results back to another rank?"""
    schedule: ExchangeSchedule
    path: ResolvedPath | None
    """How this rank orthogonalizes its stack of the group."""
    rows: RowGroup | None
    """The per-row state's companion (NorMuon), or None."""

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's shard of each parameter (computed once, on first use: a simulated
        plan's rank need not be on every mesh)."""
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

ROW_WORDS = 2
"""An fp32 entry of the per-row state travels as two bf16 words (its bits, unchanged)."""


def plan_groups(params: Sequence[ParamLayout], *, batched: bool = True) -> list[ShapeGroup]:
    """Shape groups, units, owners, schedules and paths of ``params`` (in this order).

    ``batched``: this rank orthogonalizes its units of a group in one stacked call (the path is
    resolved for that stack), else unit by unit (an eager path for one unit).
    """
    members = _group_members(params)
    units = [_units(params, idx) for idx in members]
    held = [holdings(u) for u in units]
    owners = assign_owners(units, held)
    return [
        _shape_group(params, idx, group, group_held, group_owners, batched)
        for idx, group, group_held, group_owners in zip(members, units, held, owners, strict=True)
    ]


def _shape_group(
    params: Sequence[ParamLayout],
    idx: list[int],
    units: GroupUnits,
    held: Holdings,
    owners: tuple[int, ...],
    batched: bool,
) -> ShapeGroup:
    """The plan of the shape group of the parameters at ``idx``, whose ``units`` (held as
    ``held``) have ``owners``."""
    first = params[idx[0]]
    schedule, traffic = schedule_units(units, owners, held)
    rows = None
    if first.spec.normalization is not None:
        rows = _row_group(units, first.spec, owners)
        traffic = traffic.plus(rows.traffic)
    matrices = [0] * first.domain.size
    flops = [0.0] * first.domain.size
    for o in owners:
        matrices[o] += 1
        flops[o] += units.unit_flops
    stack = len(schedule.slots) if batched else 1
    path = resolve_path(units.unit_shape, stack, first.device, first.dtype, first.spec, batched)
    return ShapeGroup(
        **units.unit_fields(),
        dtype=first.dtype,
        spec=first.spec,
        device=first.device,
        indices=tuple(idx),
        owners=owners,
        matrices_per_rank=tuple(matrices),
        flops_per_rank=tuple(flops),
        gather_send_bytes=traffic.gather_send_bytes,
        gather_recv_bytes=traffic.gather_recv_bytes,
        back_send_bytes=traffic.back_send_bytes,
        back_recv_bytes=traffic.back_recv_bytes,
        gather_comm=traffic.gather_comm,
        back_comm=traffic.back_comm,
        schedule=schedule,
        path=path,
        rows=rows,
    )


def _group_members(params: Sequence[ParamLayout]) -> list[list[int]]:
    """The positions of each shape group's parameters, groups in order of their first one.

    A single rank's own parameters (a one-rank domain) start a new group of the same key once
    a group would exceed :data:`MAX_LOCAL_GROUP_NUMEL`."""
    members: list[list[int]] = []
    open_groups: dict[tuple, list[int]] = {}  # the group a parameter of this key joins
    for i, p in enumerate(params):
        key = (p.shape, p.dtype, p.domain, p.layout.placements, p.spec)
        group = open_groups.get(key)
        if group is not None and p.domain.size == 1:
            if (len(group) + 1) * math.prod(p.shape) > MAX_LOCAL_GROUP_NUMEL:
                group = None  # full: a new group of the same shape from here on
        if group is None:
            group = open_groups[key] = []
            members.append(group)
        group.append(i)
    return members


def _units(params: Sequence[ParamLayout], idx: list[int]) -> GroupUnits:
    """The units of the parameters at ``idx`` (one shape group)."""
    p = params[idx[0]]
    ndim = len(p.shape)
    unit_dims = tuple(range(ndim)) if p.spec.flatten else (ndim - 2, ndim - 1)
    unit_flops = p.spec.flops(tuple(p.shape[d] for d in unit_dims))
    names = tuple(params[i].name for i in idx)
    return group_units(names, p.shape, p.domain, p.layout, unit_dims, unit_flops)


def _row_group(group: GroupUnits, spec: MatrixSpec, owners: tuple[int, ...]) -> RowGroup:
    """The :class:`RowGroup` of ``group`` (whose units have ``owners``)."""
    rows_shape = spec.row_shape(group.shape)
    shape = (*rows_shape, ROW_WORDS)
    placements = row_placements(group.layout.placements, len(rows_shape))
    layout = layout_of(shape, group.domain.mesh_shape, placements)
    unit_dims = (len(shape) - 2, len(shape) - 1)
    rows = GroupUnits(
        names=group.names,
        shape=shape,
        domain=group.domain,
        layout=layout,
        unit_dims=unit_dims,
        batch_dims=tuple(range(len(shape) - 2)),
        unit_shape=tuple(shape[d] for d in unit_dims),
        units=group.units,  # the parameter's units, also where a unit is empty but its rows not
        unit_flops=0.0,
    )
    schedule, traffic = schedule_units(rows, owners, holdings(rows))
    back_send = tuple(2 * n for n in traffic.back_send_bytes)  # states and factors
    back_recv = tuple(2 * n for n in traffic.back_recv_bytes)
    traffic = Traffic(traffic.gather_send_bytes, traffic.gather_recv_bytes, back_send, back_recv)
    travels = traffic.gather_comm or traffic.back_comm
    return RowGroup(
        **rows.unit_fields(),
        schedule=schedule,
        traffic=traffic,
        gather_comm=traffic.gather_comm,
        back_comm=traffic.back_comm,
        local_slots=() if travels else _local_slots(rows, schedule),
    )


def _local_slots(rows: GroupUnits, schedule: ExchangeSchedule) -> tuple[SlotRange, ...]:
    """The slots of each parameter of a companion whose units are all owned where they are
    held: unit order keeps each parameter's local units consecutive and in order."""
    direct = schedule.direct
    if direct is None:
        raise ValueError(f"internal error: the rows of {rows.names[0]!r} need traffic")
    taken: list[list[int]] = [[] for _ in rows.names]
    for slot, (k, _) in enumerate(direct):
        taken[k].append(slot)
    out = []
    for k, slots in enumerate(taken):
        if slots and slots != list(range(slots[0], slots[0] + len(slots))):
            raise ValueError(f"internal error: the rows of {rows.names[k]!r} are not consecutive")
        out.append(SlotRange(slots[0], len(slots)) if slots else SlotRange(0, 0))
    return tuple(out)


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
