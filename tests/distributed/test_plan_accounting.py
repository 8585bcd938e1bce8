"""The plan's per-rank accounting is what a real step does (gloo, world 4, one spawned job).

On FSDP (uneven and empty shards, flattened and fused matrices), FSDP x TP, HSDP and expert
stacks (sharded on the expert dim, and replicated), with both drivers, every rank counts what
its step really orthogonalizes (matrices and FLOPs, in the backend) and sends (bytes and
``all_to_all_single`` calls, on the wire), and all of it must equal the plan's report for every
rank, the numbers the scale model (``scripts/plan_at_scale.py``) builds from one process.
Some matrices run NorMuon, whose per-row states and factors travel in the same all-to-alls and
are counted in the same bytes.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import device_type, run_distributed
from plan_accounting import BACKEND, check_step_accounting, install_counting_backend, random_grads
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from muon_plugin import Muon, MuonForeach


def bag(shapes: dict[str, tuple[int, ...]], seed: int) -> nn.Module:
    module = nn.Module()
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        module.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen)))
    return module


def groups(named, **options_by_name):
    """One Muon group on the counting backend, parameters named in ``options_by_name`` in
    groups of their own with those options."""
    plain = [(n, p) for n, p in named if n not in options_by_name]
    out = [{"params": [p for _, p in plain], "param_names": [n for n, _ in plain]}]
    for name, options in options_by_name.items():
        p = dict(named)[name]
        out.append({"params": [p], "param_names": [name], **options})
    for g in out:
        g["backend"] = BACKEND
    return out


def step_twice(named, label: str, backend, **options) -> None:
    for driver in (MuonForeach, Muon):
        opt = driver(groups(named, **options), lr=0.02)
        for step in range(2):
            random_grads(named, step)
            check_step_accounting([opt], opt.step, backend, f"{label} [{driver.__name__}]")


def fsdp(mesh, backend) -> None:
    shapes = {"even": (32, 16), "uneven": (6, 8), "tiny": (2, 24), "tall": (40, 12)}
    shapes |= {"conv": (8, 3, 4), "qkv": (24, 8)}
    model = bag(shapes, seed=1)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    normuon = {"normalization": "normuon"}
    step_twice(
        named, "fsdp", backend, conv={"flatten": True},
        qkv={"split_sizes": (8, 8, 8), **normuon}, tall=normuon, uneven=normuon,
    )  # fmt: skip


def fsdp_tp(mesh, backend) -> None:
    model = nn.Sequential(*(nn.Linear(18, 36, bias=False) for _ in range(2)))
    model.append(nn.Linear(36, 18, bias=False))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    named = list(model.named_parameters())
    step_twice(named, "fsdp x tp", backend, **{"1.weight": {"normalization": "normuon"}})


def hsdp(mesh, backend) -> None:
    model = bag({f"m{i}": (16 + 4 * (i % 2), 24) for i in range(5)} | {"odd": (3, 8)}, seed=4)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    step_twice(named, "hsdp", backend, m1={"normalization": "normuon"})


def experts(mesh, backend) -> None:
    model = bag({"w1": (8, 12, 8), "w2": (8, 8, 12), "ragged": (6, 6, 10)}, seed=6)
    fully_shard(model, mesh=mesh)  # Shard(0), the expert dim
    named = list(model.named_parameters())
    step_twice(named, "experts", backend)
    replicated = [
        (n, nn.Parameter(distribute_tensor(p.full_tensor().detach(), mesh, [Replicate()])))
        for n, p in named
    ]
    step_twice(replicated, "experts replicated", backend)


def job(rank: int, ws: int) -> None:
    backend = install_counting_backend()
    flat = init_device_mesh(device_type(), (ws,))
    fsdp(flat, backend)
    fsdp_tp(init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("dp", "tp")), backend)
    hsdp(init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("r", "s")), backend)
    experts(flat, backend)


@pytest.mark.timeout(300)
def test_plan_accounting_equals_the_step_world4():
    run_distributed(job, 4)
