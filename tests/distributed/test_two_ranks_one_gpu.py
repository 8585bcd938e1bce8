"""Two ranks on one GPU (gloo, every rank's tensors on ``cuda:0``): the distributed step with
the GPU paths it takes on a cluster, where NCCL refuses two ranks on one device.

The parameters are DTensors built from local shards (``DTensor.from_local``, no collective),
Shard(0) (FSDP-like) and Shard(1) (TP row-parallel-like) on a 1-D mesh of 2, plus an expert
stack sharded on its expert dim, at sizes where the Triton symmetric kernel (4096 x 4096),
Gram-space iteration and CUDA graphs run. Every rank steps a single-device reference on the
full tensors itself and compares its own shards with the reference's (no ``full_tensor()``:
DTensor's functional collectives crashed with gloo on CUDA tensors on torch 2.11). The shards travel
through the plan's all-to-alls (gloo on CUDA tensors), the ranks' per-step agreement check is
an all-reduce of CUDA tensors. A second test trains a small model under FSDP2 (``fully_shard``:
its all-gathers and reduce-scatters on gloo with CUDA tensors). GPU only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import BACKEND_ENV, GPU_UPDATE_RTOL, run_distributed, update_difference
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from muon_plugin import MuonForeach

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {  # name: (global shape, sharded dim)
    "wq": ((4096, 4096), 0),  # the Triton symmetric kernel's region on an H100 / H200
    "w1": ((2816, 1024), 0),
    "w2": ((1024, 2816), 1),
    "wo": ((1024, 1024), 1),
    "experts": ((8, 512, 256), 0),
    **{f"small{i}": ((256, 768), 0) for i in range(6)},
}
STEPS = 3


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen, device="cuda") * 0.02
        for name, (shape, _) in SHAPES.items()
    }


def shard(t: torch.Tensor, dim: int, rank: int, ws: int) -> torch.Tensor:
    """This rank's piece of ``t``, a copy (a view would alias the tensor it is compared with)."""
    return t.chunk(ws, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def job_sharded_parameters(rank: int, ws: int) -> None:
    mesh = init_device_mesh("cuda", (ws,))
    start = full_tensors(0)
    ref = {n: nn.Parameter(t.clone()) for n, t in start.items()}
    params = {
        n: nn.Parameter(
            DTensor.from_local(shard(t, SHAPES[n][1], rank, ws), mesh, [Shard(SHAPES[n][1])],
                               run_check=False)
        )
        for n, t in start.items()
    }  # fmt: skip
    names = list(SHAPES)
    opt = MuonForeach([{"params": [params[n] for n in names], "param_names": names}], lr=0.02)
    ref_opt = MuonForeach([{"params": [ref[n] for n in names], "param_names": names}], lr=0.02)
    for step in range(STEPS):
        grads = full_tensors(100 + step)
        for n in names:
            ref[n].grad = grads[n]
            local = shard(grads[n], SHAPES[n][1], rank, ws)
            params[n].grad = DTensor.from_local(local, mesh, [Shard(SHAPES[n][1])], run_check=False)
        opt.step()
        ref_opt.step()
    torch.cuda.synchronize()
    differences = {
        n: update_difference(
            params[n].to_local(),
            shard(ref[n].detach(), SHAPES[n][1], rank, ws),
            shard(start[n], SHAPES[n][1], rank, ws),
        )
        for n in names
    }
    assert max(differences.values()) <= GPU_UPDATE_RTOL, differences
    print(f"rank {rank}: update differences {differences}")
    reports: list = [None] * ws  # each rank resolves the paths of the stacks it owns
    dist.all_gather_object(reports, opt.format_plan_report())
    print(f"rank {rank}: plan report\n{reports[rank]}")
    assert any("triton" in r for r in reports) and any("graph" in r for r in reports), reports
    stats = opt._plans.plan.last_stats
    assert stats.get("collectives", 0) > 0, stats


def job_fsdp2_model(rank: int, ws: int) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).cuda()
    ref = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).cuda()
    ref.load_state_dict(model.state_dict())
    fully_shard(model, mesh=mesh)

    def groups(m: nn.Module) -> list[dict]:
        named = list(m.named_parameters())
        matrices = [(n, p) for n, p in named if p.dim() == 2]
        vectors = [(n, p) for n, p in named if p.dim() != 2]
        return [
            {"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices]},
            {"params": [p for _, p in vectors], "param_names": [n for n, _ in vectors],
             "algorithm": "adamw"},
        ]  # fmt: skip

    opt = MuonForeach(groups(model), lr=0.02)
    ref_opt = MuonForeach(groups(ref), lr=0.02)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(STEPS):
        gen = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(16, 512, generator=gen, device="cuda")  # the same batch on both ranks
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.cuda.synchronize()
    differences = {}
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        local = p.to_local()
        rows = local.shape[0]
        want = q.detach()[rank * rows : (rank + 1) * rows]
        differences[n] = update_difference(local, want, init[n][rank * rows : (rank + 1) * rows])
    assert max(differences.values()) <= GPU_UPDATE_RTOL, differences
    print(f"rank {rank}: update differences {differences}")


def test_sharded_parameters_step_like_one_device(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "gloo-cuda")
    run_distributed(job_sharded_parameters, 2)


def test_fsdp2_trains_like_one_device(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "gloo-cuda")
    run_distributed(job_fsdp2_model, 2)
