"""NorMuon under FSDP2, TP, FSDP x TP, HSDP, expert stacks and replicated layouts (gloo, world 2
and 4): the distributed step equals the single-process one bit for bit, weights and per-row
second moments alike, on every rank holding a copy of a row.

The normalization runs on the rank that orthogonalizes a whole matrix; the rows' second moments
travel there with the shards and back with the update. The companion scenario shows what the
exactness checks guard against: on the same data, normalizing each rank's local shard alone
(the row statistics of a column shard, a rescale per row shard) gives other updates.

With ``MUON_TEST_BACKEND=nccl`` the scenarios run on GPUs, where the weights are compared up to
``dist_utils.GPU_UPDATE_RTOL`` as in ``test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import GPU_UPDATE_RTOL, device_type, exact, run_distributed, update_difference
from test_distributed import (
    TP_PLAN,
    Mats,
    blocks,
    check_index_maps,
    check_plan,
    full,
    set_random_grads,
    split_groups,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from muon_plugin import Muon, MuonForeach
from muon_plugin.distributed.layout import layout_of
from muon_plugin.functional import momentum_update_
from muon_plugin.learning_rate import LrShapeRule
from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack
from muon_plugin.orthogonalize.normuon import normuon_factors_, scale_rows
from muon_plugin.orthogonalize.spec import RowNormalization
from muon_plugin.row_state import ROW_STATE_KEY

KWARGS = dict(lr=0.02, wd=0.1, momentum=0.9, normalization="normuon", normuon_beta2=0.9)


def local_piece(full_tensor: torch.Tensor, p: DTensor) -> torch.Tensor:
    """This rank's piece of ``full_tensor`` under ``p``'s layout (placements, mesh)."""
    mesh = p.device_mesh
    layout = layout_of(tuple(p.shape), tuple(mesh.mesh.shape), tuple(p.placements))
    j = layout.linear(tuple(mesh.get_coordinate()))
    out = full_tensor
    for d in range(out.ndim):
        idx = [i for a, b in layout.index[d][j].runs for i in range(a, b)]
        out = out.index_select(d, torch.tensor(idx, dtype=torch.long, device=out.device))
    return out


def compare(named, driver, label, steps=2, extra_groups=None, replicate_group=None):
    """``steps`` NorMuon steps distributed and on gathered copies here: weights and second
    moments equal (on every rank, replicas included); returns the plan report."""
    extra_groups = extra_groups or {}
    ref_named = [(n, nn.Parameter(full(p).detach().clone())) for n, p in named]
    init = None if exact() else [q.detach().clone() for _, q in ref_named]
    opt = driver(split_groups(named, **extra_groups), replicate_group=replicate_group, **KWARGS)
    ref = driver(split_groups(ref_named, **extra_groups), **KWARGS)
    for step in range(steps):
        set_random_grads(named, step)
        for (_, p), (_, q) in zip(named, ref_named, strict=True):
            q.grad = full(p.grad).detach().clone()
        opt.step()
        ref.step()
    muon = {n for g in opt.param_groups if g["algorithm"] == "muon" for n in g["param_names"]}
    for i, ((name, p), (_, q)) in enumerate(zip(named, ref_named, strict=True)):
        if name not in muon:
            continue
        got = full(p.detach())
        if init is not None:
            rel = update_difference(got, q.detach(), init[i])
            assert rel <= GPU_UPDATE_RTOL, f"{label}: the update of {name} is off by {rel:.3f}"
            continue
        assert torch.equal(got, q.detach()), f"{label} [{driver.__name__}]: {name} differs"
        state, ref_state = opt.state[p][ROW_STATE_KEY], ref.state[q][ROW_STATE_KEY]
        if isinstance(p, DTensor):
            assert isinstance(state, DTensor) and state.device_mesh == p.device_mesh, name
            mine = local_piece(ref_state, state)  # this rank's rows, replicas included
            assert torch.equal(state.to_local(), mine), f"{label}: {name}'s second moment"
        else:
            assert torch.equal(state, ref_state), f"{label}: {name}'s second moment"
    return opt.plan_report()


def row_traffic(report) -> int:
    return sum(sum(row["send_bytes_per_rank"]) for row in report)


# ---------------------------------------------------------------------- scenarios


def scenario_fsdp(rank: int, ws: int) -> None:
    """Shard(0): uneven and empty row shards, a flattened conv weight, fused QKV blocks."""
    mesh = init_device_mesh(device_type(), (ws,))
    shapes = {
        "even": (32, 16),
        "uneven": (6, 8),
        "tiny": (2, 24),
        "conv_w": (8, 3, 4),
        "qkv": (24, 8),
        "bias": (16,),
    }
    model = Mats(shapes, seed=21)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    placements = model.even.placements
    report = compare(
        named,
        MuonForeach,
        "fsdp",
        extra_groups={"conv_w": {"flatten": True}, "qkv": {"split_sizes": (8, 12, 4)}},
    )
    check_plan(report, "fsdp", matrices=5)
    assert placements == (Shard(0),) and row_traffic(report) > 0


def scenario_tp(rank: int, ws: int) -> None:
    """Colwise Shard(0) and rowwise Shard(1): a row split across column shards is normalized
    whole, and every TP rank keeps the same copy of its second moment."""
    mesh = init_device_mesh(device_type(), (ws,), mesh_dim_names=("tp",))
    for driver in (Muon, MuonForeach):
        model = blocks(18, 36, 2, seed=22)
        for block in model:
            parallelize_module(block, mesh, TP_PLAN)
        named = list(model.named_parameters())
        report = compare(named, driver, "tp")
        check_plan(report, "tp", matrices=8)
        opt = MuonForeach(split_groups(named), **KWARGS)
        set_random_grads(named, 0)
        opt.step()
        rowwise = dict(named)["0.wo.weight"]
        assert rowwise.placements == (Shard(1),)
        assert opt.state[rowwise][ROW_STATE_KEY].placements == (Replicate(),)


def scenario_fsdp_tp(rank: int, ws: int) -> None:
    """FSDP x TP as torchtitan builds it: _StridedShard rows and (Shard(0), Shard(1))."""
    mesh = init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("dp", "tp"))
    model = blocks(18, 36, 2, seed=23)
    for block in model:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    named = list(model.named_parameters())
    check_index_maps(named, "fsdp-tp")
    report = compare(named, MuonForeach, "fsdp-tp")
    check_plan(report, "fsdp-tp", matrices=8)


def scenario_hsdp(rank: int, ws: int) -> None:
    """(Replicate, Shard(0)): both replicas of a row shard get the owner's second moment."""
    mesh = init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    model = Mats({f"m{i}": (16, 24) for i in range(5)} | {"odd": (3, 8)}, seed=24)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    report = compare(named, MuonForeach, "hsdp")
    check_plan(report, "hsdp", matrices=6)


def scenario_experts(rank: int, ws: int) -> None:
    """3-D stacks sharded on the expert dim (no traffic at all), then replicated."""
    mesh = init_device_mesh(device_type(), (ws,))
    shapes = {"w1": (2 * ws, 12, 8), "w2": (2 * ws, 8, 12), "ragged": (ws + 1, 6, 10)}
    model = Mats(shapes, seed=25)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    report = compare(named, MuonForeach, "experts")
    check_plan(report, "experts", no_traffic=True)
    rep = [
        (n, nn.Parameter(distribute_tensor(p.full_tensor().detach(), mesh, [Replicate()])))
        for n, p in named
    ]
    report = compare(rep, MuonForeach, "experts-replicated")
    check_plan(report, "experts-replicated")


def scenario_ddp(rank: int, ws: int) -> None:
    """Plain tensors replicated over the world (DDP): owners' results all-gathered."""
    model = Mats({f"m{i}": (12, 16) for i in range(2 * ws)}, seed=26)
    named = list(model.named_parameters())
    report = compare(named, MuonForeach, "ddp", replicate_group=dist.group.WORLD)
    assert all(max(r["matrices_per_rank"]) < 2 * ws for r in report), report


def scenario_local_shards_would_differ(rank: int, ws: int) -> None:
    """On the same data, NorMuon computed on each rank's local shard of the orthogonalized
    matrix (row shards rescaled alone, row statistics of column shards) differs from NorMuon
    on the whole matrix, which the scenarios above find on every rank: so they can fail."""
    mesh = init_device_mesh(device_type(), (ws,))
    spec = MatrixSpec(
        output_scale=LrShapeRule("keller"),
        normalization=RowNormalization(0.9, 1e-8, "frobenius"),
    )
    gen = torch.Generator().manual_seed(27)
    # Rows of very different sizes: what a per-shard rescale or per-shard statistic misses.
    G = torch.randn(16, 24, generator=gen) * torch.rand(16, 1, generator=gen) * 4
    worst = torch.zeros(())
    for placement in (Shard(0), Shard(1)):
        p = nn.Parameter(distribute_tensor(torch.zeros(16, 24), mesh, [placement]))
        p.grad = distribute_tensor(G, mesh, [placement])
        (direction,) = momentum_update_([G.clone()], [torch.zeros(16, 24)], 0.9, True)
        ortho = orthogonalize_stack(direction[None], MatrixSpec(output_scale=LrShapeRule("keller")))
        whole = scale_rows(ortho, normuon_factors_(ortho, torch.zeros(1, 16), spec))[0]
        local_ortho = local_piece(ortho[0], p)[None]
        rows = local_ortho.shape[1]
        shard = scale_rows(local_ortho, normuon_factors_(local_ortho, torch.zeros(1, rows), spec))[
            0
        ]
        exact_local = local_piece(whole, p)
        rel = (shard - exact_local).norm() / exact_local.norm()
        worst = torch.maximum(worst, rel)
        # ... while the distributed optimizer's own update is the whole-matrix one.
        opt = MuonForeach([p], lr=1.0, wd=0.0, momentum=0.9, lr_adjust="keller",
                          normalization="normuon", normuon_beta2=0.9)  # fmt: skip
        opt.step()
        assert torch.equal(-p.to_local(), exact_local), placement
        if placement == Shard(1):  # every column shard differs (its rows' statistics)
            assert rel > 0.05, (placement, rel.item())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    assert worst > 0.05, worst.item()


# ---------------------------------------------------------------------- jobs


def job_world4(rank: int, ws: int) -> None:
    for scenario in (
        scenario_fsdp,
        scenario_tp,
        scenario_fsdp_tp,
        scenario_hsdp,
        scenario_experts,
        scenario_ddp,
        scenario_local_shards_would_differ,
    ):
        scenario(rank, ws)


def job_world2(rank: int, ws: int) -> None:
    for scenario in (
        scenario_fsdp,
        scenario_tp,
        scenario_fsdp_tp,
        scenario_experts,
        scenario_local_shards_would_differ,
    ):
        scenario(rank, ws)


@pytest.mark.timeout(400)
def test_normuon_layouts_world4():
    run_distributed(job_world4, 4)


@pytest.mark.timeout(300)
def test_normuon_layouts_world2():
    run_distributed(job_world2, 2)
