"""``skip_nonfinite`` on FSDP-style ``Shard(0)`` DTensors (gloo, 2 ranks).

One rank's shard of a matrix holds a NaN or Inf gradient entry; every rank that holds a shard
of that matrix must skip it (weights and momentum unchanged), and the others must update as
without the bad matrix, for Muon, MuonForeach and MuonLP.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import device, device_type, run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muon_plugin import Muon, MuonForeach

SHAPES = [(64, 128), (32, 64), (64, 128)]  # matrix 0 gets the bad entry, on rank 1's shard


def global_tensor(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def drivers():
    out = [("Muon", Muon, {}), ("MuonForeach", MuonForeach, {})]
    try:
        import torchao  # noqa: F401

        from muon_plugin.lp import MuonLP

        out.append(("MuonLP", MuonLP, {"state_dtype": "int8", "block_size": 64}))
    except ImportError:
        pass
    return out


def job(rank: int, ws: int) -> None:
    mesh = init_device_mesh(device_type(), (ws,), mesh_dim_names=("fsdp",))
    for name, driver, extra in drivers():
        for value in (math.nan, math.inf):
            params = [
                torch.nn.Parameter(distribute_tensor(global_tensor(s, i), mesh, [Shard(0)]))
                for i, s in enumerate(SHAPES)
            ]
            opt = driver(params, lr=0.02, skip_nonfinite=True, **extra)
            for step in range(3):
                grads = [global_tensor(s, 100 * step + i + 10) for i, s in enumerate(SHAPES)]
                if step == 1:
                    grads[0][SHAPES[0][0] - 1, 3] = value  # the last row: rank ws-1's shard
                for p, g in zip(params, grads, strict=True):
                    p.grad = distribute_tensor(g.to(device()), mesh, [Shard(0)])
                if step == 1:
                    before = params[0].to_local().clone()
                    state = {k: v.to_local().clone() for k, v in opt.state[params[0]].items()}
                    others = [p.to_local().clone() for p in params[1:]]
                opt.step()
                if step == 1:
                    where = f"{name}, {value}, rank {rank}"
                    assert opt.skipped_updates == 1, where  # every rank holds a shard of it
                    assert torch.equal(params[0].to_local(), before), where
                    for k, v in state.items():
                        assert torch.equal(opt.state[params[0]][k].to_local(), v), (where, k)
                    for p, o in zip(params[1:], others, strict=True):
                        assert not torch.equal(p.to_local(), o), where
            for p in params:
                assert torch.isfinite(p.to_local()).all()
            assert opt.skipped_updates == 1


@pytest.mark.parametrize("ws", [2])
def test_skip_nonfinite_on_shard0_dtensors(ws):
    run_distributed(job, ws)
