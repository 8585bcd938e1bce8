"""The planner without processes: index maps, shard order, ownership, traffic, reports.

Multi-process checks against real FSDP2/TP parameters are in ``test_distributed.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from muon_plugin.distributed.layout import LayoutError, layout_of, shard_order
from muon_plugin.distributed.plan import simulate_plan
from muon_plugin.distributed.report import format_report
from muon_plugin.orthogonalize import MatrixSpec

SPEC = MatrixSpec()


def chunk(x: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """torch.chunk semantics, with missing trailing chunks empty (what Shard does)."""
    parts = list(torch.chunk(x, n))
    parts += [x[:0]] * (n - len(parts))
    return parts[i]


def indices(layout, d: int, j: int) -> list[int]:
    return [i for a, b in layout.index[d][j].runs for i in range(a, b)]


@pytest.mark.parametrize("dp,tp", [(2, 2), (3, 2), (4, 2), (3, 3), (4, 3), (2, 4), (1, 3)])
def test_fsdp_over_tp_matches_the_physical_layout(dp, tp):
    """(_StridedShard(0, sf=tp), Shard(0)): TP cuts the rows first, FSDP cuts each TP shard.

    This is what FSDP2 stores and what ``full_tensor()`` reads (also for sizes like 7 rows on
    3 x 2, where ``_StridedShard._split_tensor`` would say otherwise).
    """
    for n in range(0, 30):
        layout = layout_of((n, 3), (dp, tp), (_StridedShard(0, split_factor=tp), Shard(0)))
        for r, t in itertools.product(range(dp), range(tp)):
            j = layout.linear((r, t))
            expected = chunk(chunk(torch.arange(n), tp, t), dp, r).tolist()
            assert indices(layout, 0, j) == expected, (n, dp, tp, r, t)
            assert indices(layout, 1, j) == [0, 1, 2]


def test_hsdp_plus_tp_and_rowwise():
    layout = layout_of((10, 6), (2, 2, 3), (Replicate(), Shard(0), Shard(1)))
    for a, r, t in itertools.product(range(2), range(2), range(3)):
        j = layout.linear((a, r, t))
        assert indices(layout, 0, j) == chunk(torch.arange(10), 2, r).tolist()
        assert indices(layout, 1, j) == chunk(torch.arange(6), 3, t).tolist()
    strided = layout_of(
        (13, 4), (2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    )
    for a, r, t in itertools.product(range(2), range(2), range(2)):
        j = strided.linear((a, r, t))
        expected = chunk(chunk(torch.arange(13), 2, t), 2, r).tolist()
        assert indices(strided, 0, j) == expected


def test_plain_shards_on_one_dim_cut_left_to_right():
    layout = layout_of((11, 2), (2, 3), (Shard(0), Shard(0)))
    for a, b in itertools.product(range(2), range(3)):
        j = layout.linear((a, b))
        assert indices(layout, 0, j) == chunk(chunk(torch.arange(11), 2, a), 3, b).tolist()


def test_shard_order_decoding():
    assert shard_order((_StridedShard(0, split_factor=2), Shard(0)), (4, 2), 2) == ((1, 0), ())
    assert shard_order((Shard(0), Shard(1)), (2, 2), 2) == ((0,), (1,))
    with pytest.raises(LayoutError, match="split factor 3"):
        shard_order((_StridedShard(0, split_factor=3), Shard(0)), (2, 2), 2)


def test_unsupported_placements_are_refused():
    with pytest.raises(LayoutError, match="Partial"):
        layout_of((4, 4), (2,), (Partial(),))
    with pytest.raises(ValueError, match=r"entry #1 .*Partial"):
        simulate_plan(
            [((4, 4), (2,), (Shard(0),), SPEC), ((4, 4), (2, 2), (Replicate(), Partial()), SPEC)]
        )


# ---------------------------------------------------------------------- plans


def minimum_bytes(plan) -> int:
    """Independently: each distinct shard of a matrix sent once to its owner, results back."""
    total = 0
    for g in plan.groups:
        layout = g.layout
        n = layout.num_ranks
        for (_, b), owner in zip(g.units, g.owners, strict=True):
            sel = [torch.arange(s) for s in g.shape]
            for d, bd in zip(g.batch_dims, b, strict=True):
                sel[d] = torch.tensor([bd])
            held = []
            for j in range(n):
                mask = torch.ones((), dtype=torch.bool)
                for d in range(len(g.shape)):
                    have = torch.zeros(g.shape[d], dtype=torch.bool)
                    have[indices(layout, d, j)] = True
                    mask = mask.unsqueeze(-1) & have[sel[d]]
                held.append(mask)
            missing = ~held[owner]
            total += int(missing.sum()) * 2  # to the owner, bf16
            total += sum(int(held[j].sum()) for j in range(n) if j != owner) * 2  # back
    return total


def plan_totals(plan):
    rows = plan.report()
    sent = sum(sum(r["send_bytes_per_rank"]) for r in rows)
    recv = sum(sum(r["recv_bytes_per_rank"]) for r in rows)
    per_rank: dict[int, float] = {}
    for r in rows:
        for rank, f in zip(r["ranks"], r["flops_per_rank"], strict=True):
            per_rank[rank] = per_rank.get(rank, 0.0) + f
    return rows, sent, recv, per_rank


def llama_layers(d: int, h: int, kv: int, layers: int):
    return [(d, d), (kv, d), (kv, d), (d, d), (h, d), (d, h), (h, d)] * layers


@pytest.mark.parametrize(
    "mesh,placements_for",
    [
        ((8,), lambda colwise: (Shard(0),)),
        (
            (4, 2),
            lambda colwise: (
                (_StridedShard(0, split_factor=2), Shard(0)) if colwise else (Shard(0), Shard(1))
            ),
        ),
        ((2, 4), lambda colwise: (Replicate(), Shard(0))),
        ((8,), lambda colwise: (Replicate(),)),
    ],
    ids=["fsdp8", "fsdp4xtp2", "hsdp2x4", "replicate8"],
)
def test_every_matrix_once_balanced_and_minimal_traffic(mesh, placements_for):
    shapes = llama_layers(64, 160, 16, 4)
    entries = [
        (s, mesh, placements_for(i % 7 in (0, 1, 2, 4, 6)), SPEC) for i, s in enumerate(shapes)
    ]
    plan = simulate_plan(entries)
    rows, sent, recv, per_rank = plan_totals(plan)
    assert sum(r["matrices"] for r in rows) == len(shapes)
    assert sum(sum(r["matrices_per_rank"]) for r in rows) == len(shapes)
    mean = sum(per_rank.values()) / len(per_rank)
    assert len(per_rank) == math.prod(mesh) and max(per_rank.values()) <= 1.5 * mean, per_rank
    assert sent == recv == minimum_bytes(plan)
    assert all(r["collectives"] <= 2 for r in rows)


def test_expert_stacks_sharded_on_the_expert_dim_move_nothing():
    entries = [((16, 24, 40), (8,), (Shard(0),), SPEC), ((12, 40, 24), (8,), (Shard(0),), SPEC)]
    plan = simulate_plan(entries)
    rows, sent, _, per_rank = plan_totals(plan)
    assert sent == 0 and all(r["collectives"] == 0 for r in rows)
    assert [r["matrices"] for r in rows] == [16, 12]
    assert rows[0]["matrices_per_rank"] == [2] * 8
    assert rows[1]["matrices_per_rank"] == [2] * 6 + [0, 0]  # 12 over 8: torch.chunk sizes
    # flatten=True makes the whole stack one matrix: it must be gathered.
    flat = simulate_plan([((16, 24, 40), (8,), (Shard(0),), MatrixSpec(flatten=True))])
    _, sent, _, _ = plan_totals(flat)
    assert sent == minimum_bytes(flat) > 0


def test_experts_sharded_inside_the_matrix_are_gathered():
    entries = [((4, 24, 40), (2, 2), (Shard(0), Shard(2)), SPEC)]
    plan = simulate_plan(entries)
    rows, sent, _, _ = plan_totals(plan)
    assert rows[0]["matrices"] == 4 and sent == minimum_bytes(plan) > 0


def test_fewer_matrices_than_ranks_and_empty_shards():
    plan = simulate_plan([((3, 16), (8,), (Shard(0),), SPEC), ((2, 5), (8,), (Shard(1),), SPEC)])
    rows, sent, _, _ = plan_totals(plan)
    assert [sum(r["matrices_per_rank"]) for r in rows] == [1, 1]
    assert sent == minimum_bytes(plan)
    # Different owners: the second matrix goes to a rank that is still idle.
    owners = [g.owners[0] for g in plan.groups]
    assert owners[0] != owners[1]


def test_every_rank_builds_the_same_plan():
    entries = [(s, (4, 2), (Replicate(), Shard(0)), SPEC) for s in llama_layers(32, 96, 8, 2)]
    plans = [simulate_plan(entries, rank=r) for r in range(8)]
    owners = [[g.owners for g in p.groups] for p in plans]
    assert all(o == owners[0] for o in owners)
    # Each rank's schedule sends what the others expect to receive.
    for gi in range(len(plans[0].groups)):
        for a, b in itertools.permutations(range(8), 2):
            sa, sb = plans[a].groups[gi].schedule, plans[b].groups[gi].schedule
            assert sa.gather_send_splits[b] == sb.gather_recv_splits[a]
            assert sa.back_send_splits[b] == sb.back_recv_splits[a]


def test_report_formats():
    plan = simulate_plan([((32, 16), (4,), (Shard(0),), SPEC)] * 6)
    text = format_report(plan.report())
    assert "(32, 16)" in text and "S(0)" in text
    assert "Muon orthogonalization plan" in format_report([])


def test_report_names_the_backend_and_its_path():
    """The planner resolves each group's path once, for this rank's stack on its device."""
    entries = [((64, 160), (4,), (Shard(0),), SPEC)] * 8
    entries.append(((32, 16), (4,), (Shard(0),), MatrixSpec(backend="plain")))
    rows = simulate_plan(entries).report()
    assert [(r["backend"], r["path"]) for r in rows] == [
        ("auto", "x, bf16, eager"),
        ("plain", "x, bf16, eager"),
    ]
    gpu = simulate_plan(entries, device="cuda").report()  # resolution only: nothing runs
    assert [r["path"] for r in gpu] == ["gram, fp16 cublas, graph", "x, bf16, eager"]
    assert simulate_plan(entries, device="cuda", batched=False).report()[0]["path"] == (
        "gram, fp16 cublas, eager"
    )
    assert "auto: x, bf16, eager" in format_report(rows)


def test_buffers_follow_the_process_groups_rank_order():
    """The communicator re-lays a schedule when its process group ranks the peers otherwise:
    the same pieces per peer, the peers in the group's order (a copy: the plan's stays)."""
    entries = [(s, (4,), (Shard(0),), SPEC) for s in llama_layers(32, 96, 8, 1)]
    plan = simulate_plan(entries, rank=1)
    order = [2, 0, 3, 1]
    for g in plan.groups:
        sched = g.schedule
        before = {
            name: (list(getattr(sched, name)), list(getattr(sched, f"{name}_splits")))
            for name in ("gather_send", "gather_recv", "back_send", "back_recv")
        }
        laid = sched.lay_out(order)
        for name, (items, splits) in before.items():
            assert list(getattr(laid, f"{name}_splits")) == [splits[j] for j in order]
            per_peer = laid.by_peer[name]
            assert list(getattr(laid, name)) == [
                item for j in order for item in per_peer.get(j, [])
            ]
            assert sorted(map(repr, getattr(laid, name))) == sorted(map(repr, items))
            assert list(getattr(sched, name)) == items  # the plan's schedule is unchanged


def test_local_groups_are_cut_into_bounded_phases(monkeypatch):
    """A single rank's own matrices: shape groups and phases of at most MAX_LOCAL_GROUP_NUMEL
    elements (whole parameters, in order); one phase holds every group that communicates."""
    from muon_plugin.distributed import planner

    monkeypatch.setattr(planner, "MAX_LOCAL_GROUP_NUMEL", 3 * 64 * 64)
    monkeypatch.setattr(planner, "MAX_PHASE_NUMEL", 3 * 64 * 64)
    plain = [((64, 64), (1,), (Replicate(),), SPEC)] * 8 + [((32, 64), (1,), (Replicate(),), SPEC)]
    plan = simulate_plan(plain)
    assert [list(g.indices) for g in plan.groups] == [[0, 1, 2], [3, 4, 5], [6, 7], [8]]
    assert plan.phases == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # [6, 7] and [8] fit together
    assert sum(r["matrices"] for r in plan.report()) == 9
    sharded = [((64, 64), (2,), (Shard(0),), SPEC)] * 8  # communicates: never cut
    plan = simulate_plan(sharded)
    assert [list(g.indices) for g in plan.groups] == [list(range(8))]
    assert plan.phases == [list(range(8))]


def test_cuda_graphed_groups_share_larger_phases(monkeypatch):
    """Consecutive CUDA-graphed groups (small matrices, overlapping on side streams) share a
    phase up to MAX_GRAPHED_PHASE_NUMEL; a phase with any other group stops at MAX_PHASE_NUMEL."""
    import dataclasses

    from muon_plugin.distributed import planner

    unit = 64 * 64
    monkeypatch.setattr(planner, "MAX_LOCAL_GROUP_NUMEL", 2 * unit)
    monkeypatch.setattr(planner, "MAX_PHASE_NUMEL", 2 * unit)
    monkeypatch.setattr(planner, "MAX_GRAPHED_PHASE_NUMEL", 6 * unit)
    plan = simulate_plan([((64, 64), (1,), (Replicate(),), SPEC)] * 12)
    groups = list(plan.groups)
    assert [list(g.indices) for g in groups] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]

    def graphed(g, graph: bool):
        return dataclasses.replace(g, path=dataclasses.replace(g.path, graph=graph))

    groups = [graphed(g, k in {0, 1, 2, 3, 5}) for k, g in enumerate(groups)]  # group 4 eager
    phases = [[groups.index(g) for g in phase] for phase in planner.local_phases(groups)]
    assert phases == [[0, 1, 2], [3], [4], [5]]
    groups = [graphed(g, False) for g in groups]  # none graphed: the plain bound alone
    assert len(planner.local_phases(groups)) == 6
