"""The planner against a naive reference: owners, per-rank traffic and every rank's schedule.

The planner counts traffic per batch index and keeps a lazy heap of rank loads so that it plans
thousands of ranks in seconds. The reference here is the direct statement of its rules, unit by
unit and holder by holder: candidates are the ranks holding a whole unit, else every rank;
the least loaded wins, ties to the rank holding the most, then the smallest index; every
distinct shard goes to the owner from the replica whose ``Replicate`` coordinates equal the
owner's, and every holder gets its piece of the result back. Layouts: FSDP (uneven, empty
shards), FSDP x TP (strided), HSDP (+TP), expert stacks (EP and EP x FSDP as torchtitan lays
them out), replicated, flattened and fused matrices, and seeded random ones.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from muon_plugin.distributed.plan import simulate_plan
from muon_plugin.orthogonalize import MatrixSpec

SPEC = MatrixSpec()
WIRE = 2


def holders(g, b):
    """(rank, local batch index, numel) of every rank holding part of unit ``b``."""
    out = []
    for j in range(g.domain.size):
        index = g.layout.index
        numel = math.prod(index[d][j].size for d in g.unit_dims)
        positions = [index[d][j].position(bd) for d, bd in zip(g.batch_dims, b, strict=True)]
        if numel and None not in positions:
            out.append((j, tuple(positions), numel))
    return out


def reference_owners(groups) -> list[list[int]]:
    by_ranks = defaultdict(list)
    for gi, g in enumerate(groups):
        by_ranks[frozenset(g.domain.ranks)].append(gi)
    owners = [[-1] * len(g.units) for g in groups]
    for members in by_ranks.values():
        load = defaultdict(float)
        fixed, free = [], []
        for order, gi in enumerate(members):
            g = groups[gi]
            numel = math.prod(g.unit_shape)
            for ui, (_, b) in enumerate(g.units):
                held = {j: n for j, _, n in holders(g, b)}
                whole = [(j, n) for j, n in held.items() if n == numel]
                cands = whole or [(j, held.get(j, 0)) for j in range(g.domain.size)]
                (fixed if len(cands) == 1 else free).append((g.unit_flops, order, ui, cands))
        free.sort(key=lambda e: (-e[0], e[1], e[2]))
        for flops, order, ui, cands in fixed + free:
            ranks = groups[members[order]].domain.ranks
            j, _ = min(cands, key=lambda c: (load[ranks[c[0]]], -c[1], c[0]))
            owners[members[order]][ui] = j
            load[ranks[j]] += flops
    return owners


def reference_traffic(g, me: int):
    """Per-rank bytes of the four exchanges, and ``me``'s items per peer and local copies."""
    n = g.domain.size
    traffic = {k: [0] * n for k in ("gather_send", "gather_recv", "back_send", "back_recv")}
    peers = {k: defaultdict(list) for k in traffic}
    local = {"gather": [], "back": []}
    slots = [u for u, o in enumerate(g.owners) if o == me]
    for u, (k, b) in enumerate(g.units):
        o = g.owners[u]
        for j, local_b, numel in holders(g, b):
            shape = tuple(g.layout.index[d][j].size for d in g.unit_dims)
            sends = g.layout.sender_for(j, o) == j
            if j == o:
                if o == me:
                    local["gather"].append((slots.index(u), k, local_b))
                    local["back"].append((slots.index(u), k, local_b))
                continue
            if sends:
                traffic["gather_send"][j] += numel * WIRE
                traffic["gather_recv"][o] += numel * WIRE
            traffic["back_recv"][j] += numel * WIRE
            traffic["back_send"][o] += numel * WIRE
            if j == me:
                if sends:
                    peers["gather_send"][o].append((k, local_b, shape))
                peers["back_recv"][o].append((k, local_b, shape))
            if o == me:
                if sends:
                    peers["gather_recv"][j].append((slots.index(u), shape))
                peers["back_send"][j].append((slots.index(u), shape))
    return traffic, peers, local, slots


def check_against_reference(entries, ranks=None) -> None:
    n = max(math.prod(e[1]) for e in entries)
    for me in range(n) if ranks is None else ranks:
        plan = simulate_plan(entries, rank=me)
        assert [list(g.owners) for g in plan.groups] == reference_owners(plan.groups)
        for g in plan.groups:
            traffic, peers, local, slots = reference_traffic(g, g.domain.me)
            sched = g.schedule
            assert list(g.gather_send_bytes) == traffic["gather_send"]
            assert list(g.gather_recv_bytes) == traffic["gather_recv"]
            assert list(g.back_send_bytes) == traffic["back_send"]
            assert list(g.back_recv_bytes) == traffic["back_recv"]
            assert list(sched.slots) == slots
            assert [i[:3] for i in sched.gather_self] == local["gather"]
            assert [i[:3] for i in sched.back_self] == local["back"]
            for name in ("gather_send", "back_recv"):  # the holder's items
                got = {j: list(items) for j, items in sched.by_peer[name].items()}
                assert got == dict(peers[name]), name
            for name in ("gather_recv", "back_send"):  # the owner's (rects checked elsewhere)
                got = {j: [i[:2] for i in items] for j, items in sched.by_peer[name].items()}
                assert got == dict(peers[name]), name
            counts = [0] * g.domain.size
            for o in g.owners:
                counts[o] += 1
            assert list(g.matrices_per_rank) == counts
            assert list(g.flops_per_rank) == [c * g.unit_flops for c in counts]


def fsdp(n: int):
    return [((s, 24), (n,), (Shard(0),), SPEC) for s in (32, 6, 2, 40, 0, 7)] + [
        ((8, 3, 4), (n,), (Shard(0),), MatrixSpec(flatten=True)),
        ((24, 8), (n,), (Shard(0),), MatrixSpec(split_sizes=(8, 8, 8))),
        ((5, 7), (n,), (Shard(1),), SPEC),
    ]


def fsdp_tp(dp: int, tp: int):
    colwise = (_StridedShard(0, split_factor=tp), Shard(0))
    rowwise = (Shard(0), Shard(1))
    return [
        ((18, 18), (dp, tp), colwise, SPEC),
        ((18, 18), (dp, tp), rowwise, SPEC),
        ((36, 18), (dp, tp), colwise, SPEC),
        ((18, 36), (dp, tp), rowwise, SPEC),
    ] * 2


def hsdp(r: int, s: int):
    plain = [((16, 24), (r, s), (Replicate(), Shard(0)), SPEC)] * 6
    tp = (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    with_tp = [((13, 12), (r, s, 2), tp, SPEC), ((12, 13), (r, s, 2), (Replicate(),) * 3, SPEC)]
    return plain + [((3, 8), (r, s), (Replicate(), Shard(0)), SPEC)] + with_tp * 2


def experts(efsdp: int, ep: int, num: int):
    """Expert stacks as torchtitan 0.2.2 lays them out under EP x FSDP (Shard(1) on efsdp when
    efsdp x ep exceeds the experts), beside dense FSDP matrices on the same ranks."""
    if efsdp * ep > num:
        placements = (Shard(1), Shard(0))
    else:
        placements = (_StridedShard(0, split_factor=ep), Shard(0))
    mesh = (efsdp, ep)
    stacks = [((num, 16, 12), mesh, placements, SPEC), ((num, 12, 16), mesh, placements, SPEC)]
    return stacks * 2 + [((24, 16), (efsdp * ep,), (Shard(0),), SPEC)]


@pytest.mark.parametrize(
    "entries",
    [fsdp(1), fsdp(3), fsdp(8), fsdp_tp(2, 2), fsdp_tp(3, 2), fsdp_tp(2, 4), hsdp(2, 3)]
    + [experts(2, 2, 8), experts(2, 2, 2), experts(4, 2, 4), experts(1, 8, 16)]
    + [[((12 + 4 * (i % 2), 16), (4,), (Replicate(),), SPEC) for i in range(12)]],
    ids=lambda e: f"{len(e)}x{e[0][1]}",
)
def test_planner_equals_the_reference(entries):
    check_against_reference(entries)


def test_larger_meshes_equal_the_reference():
    """Many ranks, few of them holding a matrix (the heap path) or all of them (the scan)."""
    layer = [(256, 256), (32, 256), (32, 256), (256, 256), (896, 256), (256, 896)]
    entries = [(s, (64,), (Shard(0),), SPEC) for _ in range(4) for s in layer]
    entries += [((48, 64), (64,), (Shard(0),), SPEC)] * 5  # 48 rows: 16 ranks hold nothing
    check_against_reference(entries, ranks=(0, 17, 63))
    check_against_reference(experts(16, 4, 32), ranks=(0, 5, 63))


def random_entries(rng: random.Random):
    mesh = rng.choice([(rng.choice([2, 3, 4, 8, 16]),), (rng.choice([2, 4]), 2), (2, 3, 2)])
    out = []
    for _ in range(rng.randint(1, 8)):
        ndim = rng.choice([2, 2, 3])
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 8, 13, 24]) for _ in range(ndim))
        placements = tuple(
            Replicate() if rng.random() < 0.25 else Shard(rng.randrange(ndim)) for _ in mesh
        )
        if len(mesh) == 2 and rng.random() < 0.3:
            placements = (_StridedShard(0, split_factor=mesh[1]), Shard(0))
        out.append((shape, mesh, placements, SPEC))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_equal_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(10):
        entries = random_entries(rng)
        n = math.prod(entries[0][1])
        check_against_reference(entries, ranks=sorted({0, n - 1, rng.randrange(n)}))
