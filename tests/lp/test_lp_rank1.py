"""The rank-1 power step of fp8 momentum (muon_plugin.lp.rank1): against SVD, and sharded.

Single process: repeated steps converge to the leading singular pair; a zero matrix restarts; a
stack of matrices steps each exactly as alone.
Distributed (gloo, spawned): on 2 ranks (rows or columns sharded) and 4 ranks (a 2 x 2 mesh
sharding both, and experts sharded on a 3-D stack), the sharded step equals the single-process
step to fp32 rounding, and the factor placements follow the parameter's; MuonLP's fp8 steps with
a rank that holds no rows of a matrix equal one process's.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from muon_plugin.lp.keys import U_KEY, W_KEY
from muon_plugin.lp.rank1 import factor_placements, outer, power_step


def low_rank_plus_noise(*lead: int, rows: int = 48, cols: int = 80, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead, rows, 1, generator=gen)
    b = torch.randn(*lead, 1, cols, generator=gen)
    return 3.0 * a * b + 0.3 * torch.randn(*lead, rows, cols, generator=gen)


def test_power_steps_converge_to_leading_singular_pair():
    m = low_rank_plus_noise(3)
    w = torch.ones(3, 80)
    for _ in range(8):
        u, w = power_step(m, w, m)
    U, S, Vh = torch.linalg.svd(m)
    # u w^T -> sigma_1 u_1 v_1^T (signs cancel in the product).
    assert torch.allclose(outer(u, w), S[:, :1, None] * U[..., :1] @ Vh[..., :1, :], atol=1e-4)
    assert torch.allclose(u.norm(dim=-1), torch.ones(3), atol=1e-6)


def test_power_step_removes_most_of_a_low_rank_matrix():
    m = low_rank_plus_noise(rows=64, cols=64)
    w = torch.ones(64)
    for _ in range(3):
        u, w = power_step(m, w, m)
    residual = m - outer(u, w)
    assert residual.abs().amax() < 0.35 * m.abs().amax()


def test_zero_matrix_restarts_from_ones():
    m = torch.zeros(2, 8, 16)
    m[1] = low_rank_plus_noise(rows=8, cols=16)
    u, w = power_step(m, torch.zeros(2, 16), m)
    # matrix 0 is zero, matrix 1 has a zero start vector: both restart.
    assert torch.equal(u, torch.zeros(2, 8))
    assert torch.equal(w, torch.ones(2, 16))
    u, w = power_step(m, w, m)
    assert torch.equal(u[0], torch.zeros(8)) and torch.equal(w[0], torch.ones(16))
    assert u[1].norm() == pytest.approx(1.0, abs=1e-6)


def test_stacked_power_step_equals_each_alone():
    """``stacked=True``: each matrix of the leading dim gets exactly its own step (also where a
    batched product or a long reduction would round differently)."""
    for lead in [(), (3,)]:
        for rows in (48, 40000):
            m = torch.stack(
                [low_rank_plus_noise(*lead, rows=rows, cols=80, seed=s) for s in range(3)]
            )
            w = torch.randn(3, *lead, 80).bfloat16()
            u, w_new = power_step(m, w, None, stacked=True)
            for i in range(3):
                u_i, w_i = power_step(m[i].clone(), w[i], None)
                assert torch.equal(u[i], u_i) and torch.equal(w_new[i], w_i), (lead, rows, i)


# ---------------------------------------------------------------------- distributed


def _check_layout(m, placements, mesh) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    w0 = torch.randn(m.shape[:-2] + m.shape[-1:], generator=torch.Generator().manual_seed(1))
    u_ref, w_ref = power_step(m, w0, m)
    u_ref, w_ref = power_step(m, w_ref, m)
    p = distribute_tensor(m, mesh, placements)
    u_place = factor_placements(p, U_KEY)
    w_place = factor_placements(p, W_KEY)
    w_local = distribute_tensor(w0, mesh, w_place).to_local()
    for _ in range(2):
        u_local, w_local = power_step(p.to_local(), w_local, p)
    u = DTensor.from_local(u_local, mesh, u_place, shape=u_ref.shape, stride=u_ref.stride())
    w = DTensor.from_local(w_local, mesh, w_place, shape=w_ref.shape, stride=w_ref.stride())
    label = f"{placements}"
    assert torch.allclose(u.full_tensor(), u_ref, rtol=1e-5, atol=1e-6), label
    assert torch.allclose(w.full_tensor(), w_ref, rtol=1e-5, atol=1e-5), label


def _job_2(rank: int, ws: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (ws,))
    m = low_rank_plus_noise(rows=37, cols=64, seed=2)  # uneven row shards
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        _check_layout(m, placements, mesh)
    p = torch.distributed.tensor.distribute_tensor(m, mesh, [Shard(0)])
    assert factor_placements(p, U_KEY) == (Shard(0),)
    assert factor_placements(p, W_KEY) == (Replicate(),)


def _job_4(rank: int, ws: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2))
    m = low_rank_plus_noise(rows=40, cols=64, seed=3)
    _check_layout(m, [Shard(0), Shard(1)], mesh)  # FSDP x TP-like
    _check_layout(m, [Replicate(), Shard(0)], mesh)  # HSDP-like
    experts = low_rank_plus_noise(4, rows=16, cols=32, seed=4)
    _check_layout(experts, [Shard(0), Shard(1)], mesh)  # experts x rows
    _check_layout(experts, [Shard(0), Shard(2)], mesh)  # experts x cols
    p = torch.distributed.tensor.distribute_tensor(experts, mesh, [Shard(0), Shard(2)])
    assert factor_placements(p, U_KEY) == (Shard(0), Replicate())
    assert factor_placements(p, W_KEY) == (Shard(0), Shard(1))
    _muon_lp_with_an_empty_shard(rank, ws)


def _muon_lp_with_an_empty_shard(rank: int, ws: int) -> None:
    """MuonLP fp8 under FSDP2 on 4 ranks with a 3-row matrix (rank 3 holds no rows, yet joins
    the power step's collectives) equals one process."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from muon_plugin.lp import MuonLP

    def model() -> nn.Module:
        m = nn.Module()
        m.w = nn.Parameter(low_rank_plus_noise(rows=3, cols=4096, seed=5))
        return m

    sharded, ref = model(), model()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (ws,)))
    assert sharded.w.to_local().shape[0] == (0 if rank == 3 else 1)
    opts = [MuonLP([m.w], lr=0.02, state_dtype="fp8") for m in (sharded, ref)]
    for step in range(3):
        g = low_rank_plus_noise(rows=3, cols=4096, seed=10 + step)
        sharded.w.grad = distribute_tensor(g, sharded.w.device_mesh, sharded.w.placements)
        ref.w.grad = g
        for opt in opts:
            opt.step()
    assert torch.allclose(sharded.w.full_tensor(), ref.w, atol=1e-6)
    got = opts[0].momentum(sharded.w).full_tensor()
    assert torch.allclose(got, opts[1].momentum(ref.w), atol=1e-6)


def test_sharded_power_step_matches_one_process_2_ranks():
    run_distributed(_job_2, 2)


def test_sharded_power_step_matches_one_process_4_ranks():
    run_distributed(_job_4, 4)
