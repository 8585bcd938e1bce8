"""The scale model (scripts/plan_at_scale.py and its modules) without GPUs.

- the model shapes add up to the published parameter counts;
- the layouts are torchtitan's (the EP placements as ``tests/distributed/test_expert_parallel.py``
sees
  them on real meshes);
- each rank's traffic across nodes, counted per batch index, equals a count pair by pair;
- the peers' formulas on small cases worked by hand;
- the script writes its tables (a quick grid).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import plan_at_scale  # noqa: E402
from scale_model import plan_at_scale as plan_of  # noqa: E402
from scale_peers import dion, distmuon  # noqa: E402
from scale_shapes import MODELS, Matrix, Model, entries, placements  # noqa: E402

from muon_plugin.distributed.layout import describe_placements  # noqa: E402
from muon_plugin.distributed.plan import simulate_plan  # noqa: E402
from muon_plugin.orthogonalize import MatrixSpec  # noqa: E402

SPEC = MatrixSpec()


@pytest.mark.parametrize(
    "key,total,active",
    [
        ("llama3-8b", 8.03e9, 8.03e9),
        ("llama3-70b", 70.55e9, 70.55e9),
        ("llama3-405b", 405.85e9, 405.85e9),
        ("deepseek-v3", 671.0e9, 37.5e9),  # "671B total, 37B activated" (+ its 0.5B head)
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
    ],
)
def test_shapes_add_up_to_the_published_sizes(key, total, active):
    model = MODELS[key]()
    assert model.params == pytest.approx(total, rel=2e-3)
    assert model.active_params == pytest.approx(active, rel=2e-2)


def test_expert_layouts_are_torchtitans():
    """torchtitan 0.2.2 shards experts on dim 0 under EP x FSDP, on dim 1 once efsdp x ep
    exceeds the experts (seen on real meshes in tests/distributed/test_expert_parallel.py)."""
    stack = Matrix("w1", (8, 32, 64))
    assert placements(stack, "ep", 4, 2, 8) == (
        (2, 2),
        (_StridedShard(0, split_factor=2), Shard(0)),
    )
    assert placements(stack, "ep", 4, 2, 2) == ((2, 2), (Shard(1), Shard(0)))
    dense = Matrix("wo", (64, 32), colwise=False)
    assert placements(dense, "ep", 4, 2, 8) == ((4,), (Shard(0),))
    assert placements(dense, "fsdp_tp", 64, 1, 0) == ((8, 8), (Shard(0), Shard(1)))
    assert describe_placements(placements(Matrix("wq", (64, 64)), "fsdp_tp", 64, 1, 0)[1]) == (
        "(_S(0,8),S(0))"
    )
    assert placements(dense, "hsdp", 128, 1, 0) == ((2, 64), (Replicate(), Shard(0)))


def pairwise_inter_node(entries_, node: int):
    """Each rank's bytes to / from other nodes, unit by unit and holder by holder."""
    plan = simulate_plan(entries_)
    n = max(math.prod(e[1]) for e in entries_)
    sent, recv = [0] * n, [0] * n
    for g in plan.groups:
        index, ranks = g.layout.index, g.domain.ranks
        for (_, b), o in zip(g.units, g.owners, strict=True):
            for j in range(g.domain.size):
                numel = math.prod(index[d][j].size for d in g.unit_dims)
                held = all(
                    index[d][j].position(bd) is not None
                    for d, bd in zip(g.batch_dims, b, strict=True)
                )
                if not numel or not held or j == o or ranks[j] // node == ranks[o] // node:
                    continue
                if g.layout.sender_for(j, o) == j:
                    sent[ranks[j]] += 2 * numel
                    recv[ranks[o]] += 2 * numel
                sent[ranks[o]] += 2 * numel
                recv[ranks[j]] += 2 * numel
    return sent, recv


LAYOUTS = [
    [((s, 24), (8,), (Shard(0),), SPEC) for s in (32, 6, 2, 40)],
    [((18, 18), (4, 2), (_StridedShard(0, split_factor=2), Shard(0)), SPEC)] * 3
    + [((18, 36), (4, 2), (Shard(0), Shard(1)), SPEC)] * 2,
    [((16, 24), (4, 2), (Replicate(), Shard(0)), SPEC)] * 5,
    [((4, 16, 12), (4, 2), (Shard(1), Shard(0)), SPEC)] * 2 + [((24, 16), (8,), (Shard(0),), SPEC)],
    [((16, 8, 12), (4, 2), (_StridedShard(0, split_factor=2), Shard(0)), SPEC)],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["fsdp", "fsdp_tp", "hsdp", "ep-inside", "ep"])
@pytest.mark.parametrize("node", [1, 2, 8])
def test_traffic_across_nodes_equals_the_pairwise_count(layout, node):
    plan = plan_of(layout, 8, node=node)
    assert (plan.sent_inter, plan.received_inter) == pairwise_inter_node(layout, node)
    if node == 1:  # every peer is on another node
        assert (plan.sent_inter, plan.received_inter) == (plan.sent, plan.received)
    if node == 8:
        assert not any(plan.sent_inter) and not any(plan.received_inter)


def test_the_bound_on_imbalance_counts_matrices_that_stay():
    """Experts held whole by one rank stay there: one dense matrix on top of equal expert
    loads cannot be balanced away, and the bound says so."""
    layout = [((8, 16, 16), (8,), (Shard(0),), SPEC), ((64, 64), (8,), (Shard(0),), SPEC)]
    plan = plan_of(layout, 8)
    expert, dense = SPEC.flops((16, 16)), SPEC.flops((64, 64))
    assert plan.fixed_flops == [expert] * 8 and plan.largest_free == dense
    assert plan.max_flops == expert + dense
    assert plan.imbalance == pytest.approx(plan.imbalance_bound)
    assert plan.imbalance_bound == pytest.approx((expert + dense) / (expert + dense / 8))


def test_dion_pads_matrices_and_rows():
    """3 matrices of 6 x 4 over 4 ranks: padded to 4 matrices, each shard to 2 rows; every
    rank gets one 8 x 4 matrix and sends 3 shards of 2 x 4 bf16 each way."""
    model = Model("toy", tuple(Matrix(f"layers.{i}.w", (6, 4)) for i in range(3)), 0)
    step = dion(model, "fsdp", 4, 1, SPEC.flops)
    assert step.flops == SPEC.flops((8, 4))
    assert step.sent == 2 * 3 * (2 * 4) * 2
    assert step.collectives == 2
    assert dion(model, "fsdp_tp", 4, 1, SPEC.flops).refused


def test_distmuon_owns_whole_matrices_per_bucket_in_fp32():
    """One layer (one bucket) of a 4 x 4 and a 2 x 4 matrix on 2 ranks: the larger goes to
    rank 0, the smaller to rank 1; each rank sends its other piece out and the owner's
    result back, 4 bytes an element."""
    model = Model("toy", (Matrix("layers.0.a", (4, 4)), Matrix("layers.0.b", (2, 4))), 0)
    step = distmuon(model, "fsdp", 2, 1, SPEC.flops)
    assert step.flops == SPEC.flops((4, 4))
    # rank 0: a's other half back (8) + its row of b out (4); rank 1: a's half out (8) +
    # b's other row back (4): 12 elements each.
    assert step.sent == 12 * 4
    assert step.collectives == 2


def test_the_script_writes_its_tables(tmp_path):
    results, doc, data = tmp_path / "RESULTS.md", tmp_path / "scale.md", tmp_path / "rows.json"
    results.write_text("# Results\n\nother section\n")
    assert (
        plan_at_scale.main(
            ["--quick", "--results", str(results), "--doc", str(doc), "--json", str(data)]
        )
        == 0
    )
    text = results.read_text()
    assert "other section" in text and "<!-- plan_at_scale:start -->" in text
    for title in ("The plan per rank", "Step time", "microsoft/dion", "One largest matrix"):
        assert title in text and title in doc.read_text()
    rows = json.loads(data.read_text())
    assert len(rows) == len(plan_at_scale.QUICK_GRID)
    for row in rows:
        plan = row["plan"]
        assert sum(plan["matrices_per_rank"]) == plan["matrices"]
        assert max(plan["flops"]) >= max(plan["fixed_flops"])
        assert row["costs"]["muon"] > row["costs"]["orthogonalize"] > 0


def test_entries_cover_every_matrix():
    model = MODELS["deepseek-v3"]()
    got = entries(model, "ep", 256, SPEC, ep=8)
    assert len(got) == len(model.matrices)
    units = sum(math.prod(e[0][:-2]) for e in got)
    assert units == 58 * 3 * 256 + 58 * 3 + 61 * 5 + 3 * 3


def test_split_costs_start_from_the_whole_matrix():
    from scale_model import Hardware, split_costs

    hw = Hardware()
    whole, reduce, split = split_costs((28672, 8192), 8, 5, hw)
    assert whole.compute == pytest.approx(SPEC.flops((28672, 8192)) / hw.orth_flops)
    assert whole.traffic == 0 and split.compute < reduce.compute < whole.compute
    assert split.traffic > reduce.traffic > 0
    one = split_costs((28672, 8192), 1, 5, hw)
    assert all(c.compute == pytest.approx(whole.compute) and c.traffic == 0 for c in one)
