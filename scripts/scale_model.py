"""The distributed plan at scale: per-rank load and traffic from the real planner, a cost model.

:func:`plan_at_scale` builds the plan of a model's matrices on a simulated mesh with
``muon_plugin``'s own planner (:func:`muon_plugin.distributed.plan.simulate_plan`: every
rank's matrices, FLOPs and bytes, no processes) and splits each rank's traffic into the part
that stays inside its node (NVLink) and the part that leaves it (InfiniBand).
:func:`step_costs` turns that into time: the busiest rank's FLOPs at a measured single-GPU
rate plus its bytes over the links, beside AdamW's step and a forward/backward.
``tests/distributed/test_plan_accounting.py`` shows that these per-rank numbers are what a real step
does. The peers' traffic for the same models is in ``scale_peers.py``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from scale_shapes import NODE

from muon_plugin.distributed.plan import simulate_plan
from muon_plugin.distributed.report import totals_per_rank
from muon_plugin.distributed.schedule import WIRE_BYTES


@dataclass(frozen=True)
class Hardware:
    """The rates the cost model uses (H100 SXM; see the page for where each comes from)."""

    orth_flops: float = 1.063e15  # matmul FLOP/s of the orthogonalization, as counted by plan
    matmul_flops: float = 7.85e14  # bf16 8192^3 matmul, measured
    muon_elementwise: float = 1.143e11  # parameters/s: Muon's momentum + update, measured
    adamw: float = 9.13e10  # parameters/s: fused AdamW, measured
    nvlink: float = 450e9  # bytes/s per direction per GPU inside a node (NVLink 4)
    infiniband: float = 50e9  # bytes/s per direction per GPU across nodes (400 Gb/s NDR)
    peak_bf16: float = 989e12  # dense bf16 FLOP/s (datasheet), for the forward/backward
    mfu: float = 0.40
    tokens: int = 4 * 2**20  # global batch of a step


@dataclass
class PlanAtScale:
    """One simulated plan, summarized per rank (lists indexed by global rank)."""

    ranks: int
    groups: int
    matrices: int
    matrices_per_rank: list[int]
    flops: list[float]
    largest_unit: float  # FLOPs of the largest matrix
    sent: list[int]
    received: list[int]
    sent_inter: list[int]  # of ``sent``: to ranks of other nodes
    received_inter: list[int]
    collectives: int  # per rank and step (every rank takes part in each)
    plan_seconds: float
    fixed_flops: list[float]  # of ``flops``: matrices only this rank holds whole (they stay)
    largest_free: float  # FLOPs of the largest matrix the planner may give any rank

    @property
    def max_flops(self) -> float:
        return max(self.flops)

    @property
    def mean_flops(self) -> float:
        return sum(self.flops) / self.ranks

    @property
    def imbalance(self) -> float:
        """max / mean FLOPs per rank."""
        return self.max_flops / self.mean_flops if self.mean_flops else 1.0

    @property
    def imbalance_bound(self) -> float:
        """A lower bound on max / mean FLOPs for any assignment by the planner's rules (whole
        matrices; a matrix that only one rank holds whole stays there): the busiest rank has
        at least the mean, the largest matrix and the largest fixed load, and whoever gets the
        largest movable matrix has it on top of at least the smallest fixed load. Not always
        reachable (it ignores how the matrices pack)."""
        if not self.mean_flops:
            return 1.0
        bound = max(self.mean_flops, self.largest_unit, max(self.fixed_flops, default=0.0))
        if self.largest_free:
            bound = max(bound, min(self.fixed_flops) + self.largest_free)
        return bound / self.mean_flops


def plan_at_scale(entries: list[tuple], ranks: int, node: int = NODE) -> PlanAtScale:
    """The real planner's plan of ``entries`` (``simulate_plan``'s input) on ``ranks`` ranks,
    as seen from rank 0 (every rank's numbers are the same on every rank); ``node`` ranks
    share a node (ranks ``0 .. node - 1`` the first)."""
    start = time.perf_counter()
    plan = simulate_plan(entries)
    seconds = time.perf_counter() - start
    rows = plan.report()
    totals = totals_per_rank(rows)
    per = [totals.get(r, {"matrices": 0, "flops": 0.0, "send_bytes": 0, "recv_bytes": 0})
           for r in range(ranks)]  # fmt: skip
    sent_inter, recv_inter = [0] * ranks, [0] * ranks
    fixed, largest_free = [0.0] * ranks, 0.0
    for g in plan.groups:
        holdings = _holdings(g)
        _inter_node_traffic(g, holdings, node, sent_inter, recv_inter)
        unit_numel = math.prod(g.unit_shape)
        for (_, b), o in zip(g.units, g.owners, strict=True):
            whole = [j for j, numel in holdings[b] if numel == unit_numel]
            if len(whole) == 1 or g.domain.size == 1:  # the planner's fixed units
                fixed[g.domain.ranks[o]] += g.unit_flops
            else:
                largest_free = max(largest_free, g.unit_flops)
    collectives = sum(row["collectives"] for row in rows)
    largest = max((g.unit_flops for g in plan.groups if g.units), default=0.0)
    return PlanAtScale(
        ranks=ranks,
        groups=len(plan.groups),
        matrices=sum(len(g.units) for g in plan.groups),
        matrices_per_rank=[int(t["matrices"]) for t in per],
        flops=[t["flops"] for t in per],
        largest_unit=largest,
        sent=[int(t["send_bytes"]) for t in per],
        received=[int(t["recv_bytes"]) for t in per],
        sent_inter=sent_inter,
        received_inter=recv_inter,
        collectives=collectives,
        plan_seconds=seconds,
        fixed_flops=fixed,
        largest_free=largest_free,
    )


def _holdings(g) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Per batch index of ``g``'s units, ``(linear rank, numel)`` of the ranks holding part."""
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {b: [] for _, b in g.units}
    index = g.layout.index
    for j in range(g.domain.size):
        numel = math.prod(index[d][j].size for d in g.unit_dims)
        if not numel or not out:
            continue
        held = [[i for a, b in index[d][j].runs for i in range(a, b)] for d in g.batch_dims]
        for b in itertools.product(*held):
            if b in out:
                out[b].append((j, numel))
    return out


def _inter_node_traffic(g, holdings, node_size: int, sent: list[int], received: list[int]) -> None:
    """Add the bytes of ``g`` that cross nodes (rank ``r`` on node ``r // node_size``) to each
    rank's totals, by the planner's rule: a holder sends its piece to the owner when their
    ``Replicate`` coordinates agree and gets its piece of the result back from every owner.
    Counted per batch index (not per unit and holder), like the planner."""
    layout, ranks = g.layout, g.domain.ranks
    rep_dims = layout.replicate_mesh_dims
    replica = [tuple(layout.coordinate(j)[m] for m in rep_dims) for j in range(g.domain.size)]
    node = [r // node_size for r in ranks]
    # Per batch index: numel held per (replica, node), per replica, per node and in all.
    held_in = {}
    for b, held in holdings.items():
        by_class: dict[tuple, int] = defaultdict(int)
        by_replica: dict[tuple, int] = defaultdict(int)
        by_node: dict[int, int] = defaultdict(int)
        for j, numel in held:
            by_class[replica[j], node[j]] += numel
            by_replica[replica[j]] += numel
            by_node[node[j]] += numel
        held_in[b] = (by_class, by_replica, by_node, sum(by_node.values()))
    owners_at: dict[tuple, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    for (_, b), o in zip(g.units, g.owners, strict=True):
        by_class, by_replica, by_node, total = held_in[b]
        rep, nd = replica[o], node[o]
        # The owner receives its replica's pieces held off its node and returns every holder
        # off its node its piece of the result.
        received[ranks[o]] += (by_replica[rep] - by_class[rep, nd]) * WIRE_BYTES
        sent[ranks[o]] += (total - by_node[nd]) * WIRE_BYTES
        owners_at[b][rep, nd] += 1
    for b, held in holdings.items():
        owners = owners_at[b]
        units = sum(owners.values())
        owners_per_node: dict[int, int] = defaultdict(int)
        owners_per_replica: dict[tuple, int] = defaultdict(int)
        for (rep, nd), count in owners.items():
            owners_per_node[nd] += count
            owners_per_replica[rep] += count
        for j, numel in held:
            rep, nd = replica[j], node[j]
            far_owners = owners_per_replica[rep] - owners.get((rep, nd), 0)
            sent[ranks[j]] += numel * WIRE_BYTES * far_owners
            received[ranks[j]] += numel * WIRE_BYTES * (units - owners_per_node[nd])


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step (the busiest rank), and their parts."""

    orthogonalize: float  # the busiest rank's matrices at ``orth_flops``
    largest_matrix: float  # one largest matrix alone: no whole-matrix plan goes below it
    communicate: float  # the busiest rank's bytes over NVLink + InfiniBand
    elementwise: float  # Muon's momentum and update, and AdamW on the other parameters
    muon: float  # elementwise + the busiest rank's orthogonalization and traffic
    adamw: float  # AdamW on every parameter instead
    forward_backward: float  # 6 x active parameters x tokens at ``mfu``


def step_costs(plan: PlanAtScale, model, fraction: float, hw: Hardware) -> StepCosts:
    """The step-time estimate of ``plan`` for ``model`` (each rank holds ``fraction`` of every
    parameter). Orthogonalization and traffic are added, not overlapped: an upper bound."""
    per_rank = []
    for r in range(plan.ranks):
        inter = max(plan.sent_inter[r], plan.received_inter[r]) / hw.infiniband
        intra_sent = plan.sent[r] - plan.sent_inter[r]
        intra_recv = plan.received[r] - plan.received_inter[r]
        per_rank.append(
            (plan.flops[r] / hw.orth_flops, max(intra_sent, intra_recv) / hw.nvlink + inter)
        )
    busiest = max(per_rank, key=sum)
    elementwise = (
        model.muon_params * fraction / hw.muon_elementwise
        + model.other_params * fraction / hw.adamw
    )
    return StepCosts(
        orthogonalize=max(c for c, _ in per_rank),
        largest_matrix=plan.largest_unit / hw.orth_flops,
        communicate=max(t for _, t in per_rank),
        elementwise=elementwise,
        muon=elementwise + sum(busiest),
        adamw=model.params * fraction / hw.adamw,
        forward_backward=6 * model.active_params * hw.tokens / (plan.ranks * hw.peak_bf16 * hw.mfu),
    )


@dataclass(frozen=True)
class SplitCost:
    """One matrix's iteration split over ``ranks`` ranks by column blocks (design note
    ``docs/design/split_matrix.md``): seconds of compute and of traffic per rank."""

    variant: str
    compute: float
    traffic: float

    @property
    def total(self) -> float:
        return self.compute + self.traffic


def split_costs(shape: tuple[int, int], ranks: int, steps: int, hw: Hardware) -> list[SplitCost]:
    """Per rank, for ``steps`` plain Newton-Schulz steps on ``X`` (``m x n``, ``m <= n``) whose
    ``n`` columns are split over ``ranks`` ranks of one node (NVLink, ring collectives):

    - ``whole``: one rank does it all (``4 m^2 n + 2 m^3`` per step);
    - ``gram all-reduce``: each rank forms its ``X_i X_i^T``, an all-reduce (fp32) sums the
      ``m x m`` Gram matrix, every rank computes the polynomial ``B`` (``2 m^3``) and its own
      ``B X_i``: ``4 m^2 n / p + 2 m^3`` FLOPs and ``2 (p-1)/p 4 m^2`` bytes per step;
    - ``+ split polynomial``: each rank computes ``m / p`` rows of ``B`` and an all-gather
      (bf16) shares them: ``(4 m^2 n + 2 m^3) / p`` FLOPs, ``(p-1)/p 2 m^2`` more bytes.
    """
    m, n = sorted(shape)
    p = ranks
    ring = 2 * (p - 1) / p * 4 * m * m  # all-reduce, fp32
    gather = (p - 1) / p * 2 * m * m  # all-gather, bf16
    rate = hw.orth_flops
    return [
        SplitCost("whole", steps * (4 * m * m * n + 2 * m**3) / rate, 0.0),
        SplitCost(
            "gram all-reduce",
            steps * (4 * m * m * n / p + 2 * m**3) / rate,
            steps * ring / hw.nvlink,
        ),
        SplitCost(
            "+ split polynomial",
            steps * (4 * m * m * n + 2 * m**3) / p / rate,
            steps * (ring + gather) / hw.nvlink,
        ),
    ]
