"""Which rank orthogonalizes which whole matrix, and how the shards reach it and come back.

A plan is built once per set of parameters (the optimizer caches it) and executed every step.

**Planning** (no communication; every rank computes the same plan):

1. Each Muon parameter is described by its global shape, its *domain* (the ranks of its device
   mesh, see :mod:`~muon_plugin.distributed.groups`) and its :class:`~muon_plugin.distributed.
   layout.Layout` (which global indices every rank of the mesh holds). Plain tensors live on this
   rank alone, or, given ``replicate_group`` (DDP), are replicated over that group.
2. Parameters are grouped into *shape groups* by (global shape, dtype, domain, placements, spec).
3. Each shape group is cut into *units*: whole matrices, i.e. the last two dims of the parameter
   for every index of its leading (batch) dims, or the whole parameter when ``spec.flatten``.
4. Every unit gets one *owner*: greedily, largest estimated FLOPs first, onto the least-loaded
   candidate rank, all shape groups of a domain together (units only one rank can take go
   first). Candidates are the ranks that already hold the whole unit when there are any (expert
   stacks sharded on a batch dim, ``Replicate`` meshes: no gathering at all), else every rank of
   the mesh (ties go to the rank already holding the most of it).
5. Traffic: every distinct shard of a unit is sent once to the owner (among replicas, the one
   whose coordinates on the ``Replicate`` mesh dims equal the owner's), and the owner sends every
   holder (all replicas) its piece of the result. That is the minimum for this owner.

**Execution** (``run``), per shape group, in bf16: pack the local pieces for every owner into one
buffer, one ``all_to_all_single`` (async), assemble the owned units into a stack, orthogonalize the
stack with :func:`~muon_plugin.orthogonalize.orthogonalize_stack` (one batched call, or unit by
unit when not ``batched``), send the results back with a second ``all_to_all_single`` (async). The
gathers of the next ``prefetch`` groups are in flight while a group computes, and the returns
drain at the end. Groups that need no traffic (plain tensors, expert stacks sharded on the
expert dim) make no collective call at all; every rank of a domain makes the same calls in the
same order, also when it has nothing to send.

**Numerics**: the direction is rounded to bf16 (the wire format) before orthogonalization in
every layout, local ones included, so a parameter's update does not depend on how it is sharded:
``run`` returns, for each parameter, its local shard of
``orthogonalize_stack(full_direction.to(bf16)[None], spec)[0]``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate

from muon_plugin.cuda_graphs import GraphedOrthogonalization, use_cuda_graph
from muon_plugin.distributed.agreement import check_agreement
from muon_plugin.distributed.groups import (
    Domain,
    group_domain,
    group_ranks_of,
    local_domain,
    mesh_domain,
    process_group,
)
from muon_plugin.distributed.layout import Layout, LayoutError, describe_placements, layout_of
from muon_plugin.kernels.elementwise import FUSED_MIN_NUMEL
from muon_plugin.kernels.symmetric import triton_kernels_enabled
from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack

WIRE_DTYPE = torch.bfloat16
WIRE_BYTES = 2
# CUDA-graphed groups replayed side by side on their own streams (H200, GPT-125M: the three
# groups of 72 small matrices run 11% faster overlapped than one after another).
MAX_CONCURRENT_GROUPS = 3

Slices = tuple[slice, ...]
Rect = tuple[Slices, Slices]  # (slices into the unit, slices into the piece)


# ---------------------------------------------------------------------- data


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
    # (param k, local batch index) per slot, stacked straight into bf16 by orthogonalize_stack.
    direct: list[tuple[int, tuple[int, ...]]] | None = None


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
    group: ProcessGroup | None = None
    gather_comm: bool = False  # does any rank of the domain send anything?
    back_comm: bool = False

    @property
    def unit_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.unit_dims)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.layout.local_shape(self.domain.me)


# ---------------------------------------------------------------------- execution


@dataclass
class _InFlight:
    """One group's collective in flight, with the buffers it reads and writes."""

    work: Any
    send: Tensor
    recv: Tensor


class OrthogonalizationPlan:
    """A cached assignment of whole matrices to ranks; ``run`` maps directions to updates.

    Built by :func:`plan_orthogonalization` (or, not runnable, by :func:`simulate_plan`).
    ``last_stats`` holds this rank's bytes sent/received and collective calls of the last run.
    """

    def __init__(self, groups: list[ShapeGroup], batched: bool, prefetch: int = 2) -> None:
        self.groups = groups
        self.batched = batched
        self.prefetch = max(0, int(prefetch))
        self.last_stats: dict[str, int] = {}
        # Per group (by id): how its stack is orthogonalized (eagerly or via a CUDA graph).
        self._stack_runners: dict[int, Callable[..., Tensor]] = {}
        # Per device: the side streams on which the graphs of groups without return traffic
        # run concurrently (groups take them in turn).
        self._side_streams: dict[torch.device, list[torch.cuda.Stream]] = {}
        self._side_turns: Counter[torch.device] = Counter()

    def run(self, directions: Sequence[Tensor]) -> list[Tensor]:
        """Orthogonalize ``directions`` (local shards laid out as their parameters).

        Returns, per parameter, the local shard (same shape as the input) of the orthogonalized
        whole matrix, in bf16. Every rank of every domain must call this with the same plan.
        """
        out: list[Tensor | None] = [None] * len(directions)
        stats = {"send_bytes": 0, "recv_bytes": 0, "collectives": 0}
        groups = self.groups
        gathers: list[_InFlight | None] = [None] * len(groups)
        backs: list[tuple[_InFlight | None, Any]] = []
        launched = 0
        for gi, group in enumerate(groups):
            # Keep the gathers of the next `prefetch` groups in flight while this one computes.
            while launched < len(groups) and launched <= gi + self.prefetch:
                gathers[launched] = self._launch_gather(groups[launched], directions, stats)
                launched += 1
            stack = self._finish_gather(group, directions, gathers[gi])
            gathers[gi] = None
            result = self._orthogonalize(group, stack)
            backs.append((self._launch_back(group, result, stats), result))
        for streams in self._side_streams.values():  # the graphs' results are read below
            for stream in streams:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
        for group, (back, result) in zip(groups, backs, strict=True):
            self._finish_back(group, directions, back, result, out)
        self.last_stats = stats
        return out  # type: ignore[return-value]

    # -- the steps of one group

    def _all_to_all(
        self, group: ShapeGroup, send: Tensor, recv_splits: list[int], send_splits, stats: dict
    ) -> _InFlight:
        recv = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=group.group, async_op=True
        )
        stats["send_bytes"] += send.numel() * WIRE_BYTES
        stats["recv_bytes"] += recv.numel() * WIRE_BYTES
        stats["collectives"] += 1
        return _InFlight(work, send, recv)

    def _launch_gather(
        self, group: ShapeGroup, directions: Sequence[Tensor], stats: dict
    ) -> _InFlight | None:
        if not group.gather_comm:
            return None
        sched = group.schedule
        send = torch.empty(sum(sched.gather_send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts = list(_wire_pieces(send, (shape for _, _, shape in sched.gather_send)))
        srcs = [_piece(directions[group.indices[k]], b) for k, b, _ in sched.gather_send]
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return self._all_to_all(
            group, send, sched.gather_recv_splits, sched.gather_send_splits, stats
        )

    def _finish_gather(
        self, group: ShapeGroup, directions: Sequence[Tensor], pending: _InFlight | None
    ) -> Tensor | list[Tensor] | None:
        sched = group.schedule
        if sched.direct is not None:
            if pending is not None:
                pending.work.wait()  # others' traffic; nothing arrives here
            if not sched.direct:
                return None
            return [_piece(directions[group.indices[k]], b) for k, b in sched.direct]
        stack = None
        dsts, srcs = [], []
        if sched.slots:
            stack = torch.empty(
                (len(sched.slots), *group.unit_shape), dtype=WIRE_DTYPE, device=group.device
            )
            for slot, k, local_b, rects in sched.gather_self:
                piece = _piece(directions[group.indices[k]], local_b)
                for unit_sl, piece_sl in rects:
                    dsts.append(stack[slot][unit_sl])
                    srcs.append(piece[piece_sl])
        if pending is not None:
            pending.work.wait()
            shapes = (shape for _, shape, _ in sched.gather_recv)
            for (slot, _, rects), piece in zip(
                sched.gather_recv, _wire_pieces(pending.recv, shapes), strict=True
            ):
                assert stack is not None
                for unit_sl, piece_sl in rects:
                    dsts.append(stack[slot][unit_sl])
                    srcs.append(piece[piece_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return stack

    def _orthogonalize(
        self,
        group: ShapeGroup,
        stack: Tensor | list[Tensor] | None,
    ) -> Tensor | list[Tensor] | None:
        """The orthogonalized slots: one stacked tensor (``batched``) or one tensor per slot."""
        if stack is None:
            return None
        if self.batched:
            # Where the update takes the foreach path (no Triton kernel), small local results
            # come back in the parameter dtype (one cast per stack), so the multi-tensor update
            # stays on its single-dtype fast path; the grouped kernel reads bf16 directly.
            device = stack.device if isinstance(stack, Tensor) else stack[0].device
            foreach_update = device.type != "cuda" or not triton_kernels_enabled()
            small = not group.back_comm and math.prod(group.shape) < FUSED_MIN_NUMEL
            out_dtype = group.dtype if foreach_update and small else None
            return self._stack_runner(group, device, len(stack), out_dtype)(stack)
        if isinstance(stack, Tensor):
            return [orthogonalize_stack(stack[s : s + 1], group.spec)[0] for s in range(len(stack))]
        return [orthogonalize_stack([x], group.spec)[0] for x in stack]

    def _stack_runner(
        self,
        group: ShapeGroup,
        device: torch.device,
        size: int,
        out_dtype: torch.dtype | None,
    ) -> Callable[[Tensor | list[Tensor]], Tensor]:
        """The group's batched orthogonalization: eager, or a CUDA graph for small stacks.

        A graphed group whose results stay on this rank gets a side stream of its own (taken
        in turn, at most ``MAX_CONCURRENT_GROUPS`` per device), so small groups overlap on the
        GPU; ``run`` joins every side stream before the results are read.
        """
        runner = self._stack_runners.get(id(group))
        if runner is None:
            if use_cuda_graph(device, size, math.prod(group.unit_shape), group.spec):
                name = f"{size} matrices of shape {group.unit_shape} ({group.names[0]}, ...)"
                stream = None
                if not group.back_comm:
                    streams = self._side_streams.setdefault(device, [])
                    if len(streams) < MAX_CONCURRENT_GROUPS:
                        streams.append(torch.cuda.Stream(device))
                    stream = streams[self._side_turns[device] % len(streams)]
                    self._side_turns[device] += 1
                runner = GraphedOrthogonalization(group.spec, out_dtype, name, stream)
            else:
                runner = functools.partial(
                    orthogonalize_stack, spec=group.spec, out_dtype=out_dtype
                )
            self._stack_runners[id(group)] = runner
        return runner

    def _launch_back(self, group: ShapeGroup, result: Any, stats: dict) -> _InFlight | None:
        if not group.back_comm:
            return None
        sched = group.schedule
        send = torch.empty(sum(sched.back_send_splits), dtype=WIRE_DTYPE, device=group.device)
        dsts, srcs = [], []
        shapes = (shape for _, shape, _ in sched.back_send)
        for (slot, _, rects), piece in zip(
            sched.back_send, _wire_pieces(send, shapes), strict=True
        ):
            assert result is not None
            for unit_sl, piece_sl in rects:
                dsts.append(piece[piece_sl])
                srcs.append(result[slot][unit_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return self._all_to_all(group, send, sched.back_recv_splits, sched.back_send_splits, stats)

    def _finish_back(
        self,
        group: ShapeGroup,
        directions: Sequence[Tensor],
        pending: _InFlight | None,
        result: Any,
        out: list[Tensor | None],
    ) -> None:
        sched = group.schedule
        local_shape = group.local_shape
        single = not group.batch_dims  # one unit per parameter

        def fresh(i: int) -> Tensor:
            if out[i] is None:
                out[i] = torch.empty(local_shape, dtype=WIRE_DTYPE, device=group.device)
            return out[i]  # type: ignore[return-value]

        for k, i in enumerate(group.indices):
            if k in sched.whole_views:
                assert result is not None
                first = sched.whole_views[k]
                n = math.prod(local_shape[d] for d in group.batch_dims)
                part = result[first : first + n]
                out[i] = (part if isinstance(part, Tensor) else torch.stack(part)).view(local_shape)
            elif math.prod(local_shape) == 0:
                fresh(i)
        dsts, srcs = [], []
        for slot, k, local_b, rects in sched.back_self:
            if k in sched.whole_views:
                continue
            i = group.indices[k]
            assert result is not None
            if single and len(rects) == 1:
                out[i] = result[slot][rects[0][0]]
                continue
            piece = _piece(fresh(i), local_b)
            for unit_sl, piece_sl in rects:
                dsts.append(piece[piece_sl])
                srcs.append(result[slot][unit_sl])
        if pending is not None:
            pending.work.wait()
            shapes = (shape for _, _, shape in sched.back_recv)
            for (k, local_b, _), piece in zip(
                sched.back_recv, _wire_pieces(pending.recv, shapes), strict=True
            ):
                i = group.indices[k]
                if single:
                    out[i] = piece
                else:
                    dsts.append(_piece(fresh(i), local_b))
                    srcs.append(piece)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    # -- reporting

    def report(self) -> list[dict[str, Any]]:
        """Per shape group: layout, matrices, and matrices/bytes/FLOPs per rank of its mesh.

        Lists are indexed by linear mesh index; ``ranks`` gives the global rank of each entry.
        Bytes count both directions of a step (shards to their owners, results back).
        """
        rows = []
        for g in self.groups:
            send = [a + b for a, b in zip(g.gather_send_bytes, g.back_send_bytes, strict=True)]
            recv = [a + b for a, b in zip(g.gather_recv_bytes, g.back_recv_bytes, strict=True)]
            local = g.domain.size == 1 and g.domain.source is None
            rows.append(
                {
                    "shape": g.shape,
                    "dtype": str(g.dtype).removeprefix("torch."),
                    "placements": "local" if local else describe_placements(g.layout.placements),
                    "mesh": "x".join(map(str, g.domain.mesh_shape)),
                    "ranks": list(g.domain.ranks),
                    "params": len(g.indices),
                    "names": list(g.names),
                    "matrices": len(g.units),
                    "matrix_shape": g.unit_shape,
                    "matrices_per_rank": list(g.matrices_per_rank),
                    "send_bytes_per_rank": send,
                    "recv_bytes_per_rank": recv,
                    "gather_send_bytes_per_rank": list(g.gather_send_bytes),
                    "return_send_bytes_per_rank": list(g.back_send_bytes),
                    "flops_per_rank": list(g.flops_per_rank),
                    "collectives": int(g.gather_comm) + int(g.back_comm),
                }
            )
        return rows


def _wire_pieces(buf: Tensor, shapes: Iterable[tuple[int, ...]]) -> Iterator[Tensor]:
    """Consecutive views of the flat all-to-all buffer ``buf``, one per piece shape."""
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        yield buf[offset : offset + n].view(shape)
        offset += n


def _piece(t: Tensor, local_b: tuple[int, ...]) -> Tensor:
    """The matrix (unit) part of a local tensor at local batch index ``local_b``."""
    return t[local_b] if local_b else t


# ---------------------------------------------------------------------- planning


def plan_orthogonalization(
    params: Sequence[Tensor],
    specs: Sequence[MatrixSpec],
    *,
    batched: bool = True,
    names: Sequence[str] | None = None,
    replicate_group: ProcessGroup | Any | None = None,
    prefetch: int = 2,
    settings: Sequence[Any] | None = None,
) -> OrthogonalizationPlan:
    """Group ``params`` into shape groups, give every matrix one owner, schedule the traffic.

    Args:
        params: the Muon parameters of a step (DTensors or plain tensors), in the same order on
            every rank.
        specs: their orthogonalization specs.
        batched: orthogonalize the matrices a rank owns in one stacked call per shape group.
        names: parameter names for error messages.
        replicate_group: process group (or 1-D mesh) over which *plain* tensors are replicated
            (DDP): their matrices are then split over its ranks and the results all-gathered.
            Without it plain tensors are orthogonalized where they are.
        prefetch: shape groups whose gathers are in flight while one group computes.
        settings: per parameter, further settings the ranks of its mesh must agree on (the
            group's math settings).

    Raises:
        ValueError naming the parameter and its placements when a layout cannot be handled
        (Partial or unknown placements, a mesh this rank is not part of, a local shard that is
        not where the placements say).
        RankDisagreementError (a ValueError) on every rank of a mesh whose ranks passed other
        parameters, placements or settings (:mod:`~muon_plugin.distributed.agreement`).
    """
    params = list(params)
    specs = list(specs)
    if len(params) != len(specs):
        raise ValueError(f"{len(params)} params but {len(specs)} specs")
    names = list(names) if names is not None else [f"#{i}" for i in range(len(params))]
    replicate_domain = None
    if replicate_group is not None:
        replicate_domain = group_domain(replicate_group)
        if replicate_domain.size == 1:
            replicate_domain = None

    placed = [_place(p, names[i], replicate_domain) for i, p in enumerate(params)]
    extra = [None] * len(params) if settings is None else list(settings)
    check_agreement(
        params,
        names,
        [domain for domain, _ in placed],
        [(spec, more) for spec, more in zip(specs, extra, strict=True)],
        {"batched": batched, "prefetch": prefetch},
    )
    groups: dict[tuple, ShapeGroup] = {}
    for i, (p, spec) in enumerate(zip(params, specs, strict=True)):
        domain, layout = placed[i]
        key = (tuple(p.shape), p.dtype, domain, layout.placements, spec)
        group = groups.get(key)
        if group is None:
            device = (p.to_local() if isinstance(p, DTensor) else p).device
            group = groups[key] = ShapeGroup(tuple(p.shape), p.dtype, spec, domain, layout, device)
        group.indices.append(i)
        group.names.append(names[i])
    plan_groups = list(groups.values())
    for group in plan_groups:
        _make_units(group)
    _assign_owners(plan_groups)
    for group in plan_groups:
        _schedule(group)
    return OrthogonalizationPlan(plan_groups, batched, prefetch)


def simulate_plan(
    entries: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...], MatrixSpec]],
    *,
    rank: int = 0,
    dtype: torch.dtype = torch.float32,
    batched: bool = True,
) -> OrthogonalizationPlan:
    """The plan for hypothetical parameters, without processes (for reports and benchmarks).

    ``entries`` are ``(global shape, mesh shape, placements, spec)``; every mesh spans ranks
    ``0 .. N-1`` in row-major order and ``rank`` is the process whose schedule is built. The
    plan reports like a real one but cannot ``run``.
    """
    groups: dict[tuple, ShapeGroup] = {}
    for i, (shape, mesh_shape, placements, spec) in enumerate(entries):
        shape, mesh_shape = tuple(shape), tuple(mesh_shape)
        try:
            layout = layout_of(shape, mesh_shape, tuple(placements))
        except LayoutError as e:
            raise ValueError(f"cannot orthogonalize entry #{i} (shape {shape}): {e}") from None
        ranks = tuple(range(math.prod(mesh_shape)))
        domain = Domain(ranks, mesh_shape, rank, None)
        key = (shape, dtype, domain, layout.placements, spec)
        group = groups.get(key)
        if group is None:
            device = torch.device("cpu")
            group = groups[key] = ShapeGroup(shape, dtype, spec, domain, layout, device)
        group.indices.append(i)
        group.names.append(f"#{i}")
    plan_groups = list(groups.values())
    for group in plan_groups:
        _make_units(group)
    _assign_owners(plan_groups)
    for group in plan_groups:
        _schedule(group, make_group=False)
    return OrthogonalizationPlan(plan_groups, batched)


def _describe(p: Tensor, name: str, placements: Any = None, mesh_shape: Any = None) -> str:
    text = f"parameter {name!r} (shape {tuple(p.shape)}"
    if placements is not None:
        text += f", placements {tuple(placements)} on a mesh of shape {mesh_shape}"
    return text + ")"


def _place(p: Tensor, name: str, replicate_domain: Domain | None) -> tuple[Domain, Layout]:
    shape = tuple(p.shape)
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        mesh_shape = tuple(mesh.mesh.shape)
        what = _describe(p, name, p.placements, mesh_shape)
        domain = mesh_domain(mesh)
        if domain is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise ValueError(
                f"cannot orthogonalize {what}: rank {rank} is not part of its device mesh "
                f"{mesh.mesh.tolist()}"
            )
        try:
            layout = layout_of(shape, domain.mesh_shape, tuple(p.placements))
        except LayoutError as e:
            raise ValueError(
                f"cannot orthogonalize {what}: {e}. Muon needs whole matrices and will not "
                "orthogonalize a shard; redistribute the parameter (and its gradient) to "
                "Shard/_StridedShard/Replicate placements"
            ) from None
        expected = layout.local_shape(domain.me)
        actual = tuple(p.to_local().shape)
        if expected != actual:
            raise ValueError(
                f"cannot orthogonalize {what}: its local shard has shape {actual} but the "
                f"placements put {expected} on this rank (coordinate "
                f"{layout.coordinate(domain.me)}); padded or custom local layouts are not "
                "supported"
            )
        return domain, layout
    domain = replicate_domain if replicate_domain is not None else local_domain()
    layout = layout_of(shape, domain.mesh_shape, (Replicate(),) * len(domain.mesh_shape))
    return domain, layout


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


def _holdings(group: ShapeGroup, b: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], int]]:
    """``(linear rank, local batch index, piece numel)`` of each rank holding part of unit ``b``."""
    layout = group.layout
    out = []
    for j in range(group.domain.size):
        numel = 1
        for d in group.unit_dims:
            numel *= layout.index[d][j].size
        if numel == 0:
            continue
        local_b = []
        for d, bd in zip(group.batch_dims, b, strict=True):
            pos = layout.index[d][j].position(bd)
            if pos is None:
                break
            local_b.append(pos)
        else:
            out.append((j, tuple(local_b), numel))
    return out


def _group_holdings(group: ShapeGroup) -> dict[tuple[int, ...], list]:
    cache: dict[tuple[int, ...], list] = {}
    for _, b in group.units:
        if b not in cache:
            cache[b] = _holdings(group, b)
    return cache


def _assign_owners(groups: list[ShapeGroup]) -> None:
    """Greedy largest-first load balancing of units onto ranks, per set of ranks.

    Units of domains over the same set of ranks are balanced together; every rank of such a set
    knows all of its units, so every rank computes the same owners. (Balancing across
    overlapping but different rank sets would need knowledge some ranks do not have.)
    """
    by_ranks: dict[frozenset[int], list[ShapeGroup]] = defaultdict(list)
    for g in groups:
        by_ranks[frozenset(g.domain.ranks)].append(g)
    for members in by_ranks.values():
        load: dict[int, float] = defaultdict(float)
        fixed, free = [], []
        for gi, g in enumerate(members):
            g.owners = [-1] * len(g.units)
            holdings = _group_holdings(g)
            unit_numel = math.prod(g.unit_shape)
            for ui, (_, b) in enumerate(g.units):
                held = holdings[b]
                whole = [j for j, _, n in held if n == unit_numel]
                if whole:
                    candidates = [(j, unit_numel) for j in whole]
                else:
                    held_by = {j: n for j, _, n in held}
                    candidates = [(j, held_by.get(j, 0)) for j in range(g.domain.size)]
                entry = (g.unit_flops, gi, ui, candidates)
                (fixed if len(candidates) == 1 else free).append(entry)
        free.sort(key=lambda e: (-e[0], e[1], e[2]))
        for flops, gi, ui, candidates in fixed + free:
            g = members[gi]
            ranks = g.domain.ranks
            j, _ = min(candidates, key=lambda c: (load[ranks[c[0]]], -c[1], c[0]))
            g.owners[ui] = j
            load[ranks[j]] += flops


def _rects(layout: Layout, j: int, unit_dims: tuple[int, ...]) -> tuple[Rect, ...]:
    """Rectangles of rank ``j``'s piece of a unit: (slices into the unit, slices into the piece)."""
    per_dim = [layout.index[d][j].local_runs() for d in unit_dims]
    rects = []
    for combo in itertools.product(*per_dim):
        unit_sl = tuple(slice(g, g + n) for g, _, n in combo)
        piece_sl = tuple(slice(loc, loc + n) for _, loc, n in combo)
        rects.append((unit_sl, piece_sl))
    return tuple(rects)


def _schedule(group: ShapeGroup, make_group: bool = True) -> None:
    """Per-rank traffic and FLOPs of the group, and this rank's :class:`Schedule`."""
    domain, layout = group.domain, group.layout
    n_ranks = domain.size
    me = domain.me
    holdings = _group_holdings(group)
    unit_numel = math.prod(group.unit_shape)
    group.matrices_per_rank = [0] * n_ranks
    group.flops_per_rank = [0.0] * n_ranks
    gs, gr, bs, br = ([0] * n_ranks for _ in range(4))
    piece_shape = {
        j: tuple(layout.index[d][j].size for d in group.unit_dims) for j in range(n_ranks)
    }
    rects_of: dict[int, tuple[Rect, ...]] = {}

    def rects(j: int) -> tuple[Rect, ...]:
        if j not in rects_of:
            rects_of[j] = _rects(layout, j, group.unit_dims)
        return rects_of[j]

    # Per peer (linear rank), in unit order.
    gather_send: dict[int, list] = defaultdict(list)
    gather_recv: dict[int, list] = defaultdict(list)
    back_send: dict[int, list] = defaultdict(list)
    back_recv: dict[int, list] = defaultdict(list)
    sched = Schedule()
    slot_of: dict[int, int] = {}
    for u, (k, b) in enumerate(group.units):
        o = group.owners[u]
        group.matrices_per_rank[o] += 1
        group.flops_per_rank[o] += group.unit_flops
        held = holdings[b]
        covered = 0
        seen_senders: set[int] = set()
        if o == me:
            slot_of[u] = len(sched.slots)
            sched.slots.append(u)
        for j, local_b, numel in held:
            sender = layout.sender_for(j, o)
            if sender == j:  # one replica of each shard sends it
                covered += numel
                seen_senders.add(j)
                if j != o:
                    gs[j] += numel * WIRE_BYTES
                    gr[o] += numel * WIRE_BYTES
                    if j == me:
                        gather_send[o].append((k, local_b, piece_shape[j]))
                    if o == me:
                        gather_recv[j].append((slot_of[u], piece_shape[j], rects(j)))
                elif o == me:
                    sched.gather_self.append((slot_of[u], k, local_b, rects(j)))
            if j != o:
                bs[o] += numel * WIRE_BYTES
                br[j] += numel * WIRE_BYTES
                if o == me:
                    back_send[j].append((slot_of[u], piece_shape[j], rects(j)))
                if j == me:
                    back_recv[o].append((k, local_b, piece_shape[j]))
            elif o == me:
                sched.back_self.append((slot_of[u], k, local_b, rects(j)))
        if covered != unit_numel:
            raise ValueError(
                f"internal error: shards of {group.names[k]!r} (placements "
                f"{describe_placements(layout.placements)}, mesh {domain.mesh_shape}) cover "
                f"{covered} of {unit_numel} elements of a matrix"
            )
    group.gather_send_bytes, group.gather_recv_bytes = gs, gr
    group.back_send_bytes, group.back_recv_bytes = bs, br
    group.gather_comm = any(gs)
    group.back_comm = any(bs)
    needs_group = make_group and (group.gather_comm or group.back_comm)
    group.group = process_group(domain) if needs_group else None
    # Buffers are laid out by rank inside the process group.
    group_rank = group_ranks_of(domain, group.group)
    by_group_rank = sorted(range(n_ranks), key=lambda j: group_rank[j])

    def flatten(per_peer: dict[int, list], size_of) -> tuple[list, list[int]]:
        items, splits = [], []
        for j in by_group_rank:
            peer = per_peer.get(j, [])
            items += peer
            splits.append(sum(size_of(item) for item in peer))
        return items, splits

    sched.gather_send, sched.gather_send_splits = flatten(gather_send, lambda it: math.prod(it[2]))
    sched.gather_recv, sched.gather_recv_splits = flatten(gather_recv, lambda it: math.prod(it[1]))
    sched.back_send, sched.back_send_splits = flatten(back_send, lambda it: math.prod(it[1]))
    sched.back_recv, sched.back_recv_splits = flatten(back_recv, lambda it: math.prod(it[2]))
    # Params made only of whole units owned here, in consecutive slots: views of the result.
    if group.batch_dims and unit_numel:
        my_local = math.prod(group.local_shape[d] for d in group.batch_dims)
        firsts: dict[int, list[int]] = defaultdict(list)
        for slot, k, _local_b, rects_ in sched.back_self:
            unit_sl, _ = rects_[0]
            whole = len(rects_) == 1 and all(
                s.stop - s.start == n for s, n in zip(unit_sl, group.unit_shape, strict=True)
            )
            firsts[k].append(slot if whole else -1)
        for k, slots in firsts.items():
            if (
                len(slots) == my_local
                and slots[0] >= 0
                and slots == list(range(slots[0], slots[0] + my_local))
            ):
                sched.whole_views[k] = slots[0]
    if not sched.gather_recv:
        full_rect = tuple(slice(0, n) for n in group.unit_shape)
        whole = [
            (slot, k, local_b)
            for slot, k, local_b, rects_ in sched.gather_self
            if len(rects_) == 1 and rects_[0][0] == full_rect
        ]
        if len(whole) == len(sched.gather_self) == len(sched.slots):
            sched.direct = [(k, local_b) for _, k, local_b in sorted(whole)]
    group.schedule = sched


def check_grad_layouts(group: dict[str, Any], params: Sequence[Tensor]) -> None:
    """Raise ValueError when a DTensor gradient is not laid out like its parameter.

    The momentum math runs on local shards, which is only right when the gradient's shard is
    the parameter's shard (a ``Partial`` gradient, say, would be summed into momentum unreduced).
    """
    names = group.get("param_names")
    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and (
            not isinstance(g, DTensor)
            or g.placements != p.placements
            or g.device_mesh != p.device_mesh
        ):
            i = next(i for i, q in enumerate(group["params"]) if q is p)
            name = repr(names[i]) if names else f"#{i}"
            got = tuple(g.placements) if isinstance(g, DTensor) else type(g).__name__
            raise ValueError(
                f"the gradient of parameter {name} (shape {tuple(p.shape)}) has placements "
                f"{got} but the parameter has {tuple(p.placements)}; redistribute the gradient "
                "to the parameter's placements before the optimizer step"
            )
