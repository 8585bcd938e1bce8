"""A ``"turbo_muon"`` group on sharded DTensors (gloo, 2 ranks) equals one process.

FSDP ``Shard(0)`` (even, uneven and tall matrices) and a column-sharded ``Shard(1)`` matrix,
in a turbo_muon x4 group beside a default (polar_express) group: after two steps every
parameter equals the single-process ``Muon`` / ``MuonForeach`` fed the gathered gradients, bit
for bit (the shared functions of ``tests/distributed/test_distributed.py``).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import device_type, run_distributed
from test_distributed import DRIVERS, Mats, check_plan, compare_with_single_process
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

TURBO = {"orthogonalization_strategy": "turbo_muon", "ns_steps": 4}


def job(rank: int, ws: int) -> None:
    mesh = init_device_mesh(device_type(), (ws,))
    for driver in DRIVERS:
        shapes = {"t_even": (32, 16), "t_uneven": (6, 8), "t_tall": (40, 12), "pe": (32, 16)}
        model = Mats(shapes, seed=4)
        fully_shard(model, mesh=mesh)
        named = list(model.named_parameters())
        g = torch.Generator().manual_seed(5)
        col = distribute_tensor(torch.randn(24, 40, generator=g) * 0.1, mesh, [Shard(1)])
        named.append(("t_cols", nn.Parameter(col)))
        report = compare_with_single_process(named, driver, "turbo", extra_groups={"t_": TURBO})
        check_plan(report, "turbo", matrices=5)


@pytest.mark.timeout(200)
def test_turbo_muon_sharded_equals_one_process():
    run_distributed(job, 2)
