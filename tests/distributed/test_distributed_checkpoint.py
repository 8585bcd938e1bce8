"""DCP round trips of Muon state across layouts (gloo, 4 CPU processes).

Train two steps under FSDP=4, save with ``torch.distributed.checkpoint`` (flattened optimizer
state dict, as torchtitan does), load under FSDP=2 x TP=2, take a third step: parameters and
momentum equal those of the uninterrupted FSDP=4 run. And the reverse. The second block's
matrices run NorMuon, so their per-row second moments are resharded too (from row shards to
TP's replicated rows of a column-sharded matrix, and back).

With ``MUON_TEST_BACKEND=nccl`` it runs on 4 GPUs; the third step's Muon update is then compared
up to ``dist_utils.GPU_UPDATE_RTOL`` (GPU matmuls round differently across layouts).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import (
    GPU_UPDATE_RTOL,
    device,
    device_type,
    exact,
    run_distributed,
    update_difference,
)
from test_distributed import TP_PLAN, blocks, seed_of, split_groups
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from muon_plugin import MuonForeach
from muon_plugin.distributed.layout import layout_of

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
KWARGS = dict(lr=0.02, wd=0.1, momentum=0.9)
NORMUON = {"normalization": "normuon", "normuon_beta2": 0.9}
D, H = 16, 40


def build(layout: str):
    model = blocks(D, H, 2, seed=11)
    if layout == "fsdp4":
        mesh = init_device_mesh(device_type(), (4,), mesh_dim_names=("fsdp",))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model:
            parallelize_module(block, mesh["tp"], TP_PLAN)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    groups = split_groups(list(model.named_parameters()), **{"1.w": NORMUON})
    return model, MuonForeach(groups, **KWARGS)


def global_grad(name: str, shape, step: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed_of(name, step)))


def set_grads(model, step: int) -> None:
    """The same global gradients in every layout, cut where each rank's shard sits."""
    for name, p in model.named_parameters():
        g = global_grad(name, tuple(p.shape), step).to(device())
        grad = torch.zeros_like(p)
        mesh = p.device_mesh
        layout = layout_of(tuple(p.shape), tuple(mesh.mesh.shape), tuple(p.placements))
        j = layout.linear(tuple(mesh.get_coordinate()))
        piece = g
        for d in range(g.ndim):
            idx = [i for a, b in layout.index[d][j].runs for i in range(a, b)]
            piece = piece.index_select(d, torch.tensor(idx, dtype=torch.long, device=g.device))
        grad.to_local().copy_(piece)
        assert torch.equal(grad.full_tensor(), g), name  # torch agrees on where it sits
        p.grad = grad


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if isinstance(value, DTensor):
                out[f"{n}.{key}"] = value.full_tensor().clone()
    return out


def state_dicts(model, opt) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=OPTIONS),
    }


def job_reshard(rank: int, ws: int, root: str) -> None:
    for src, dst in (("fsdp4", "fsdp2xtp2"), ("fsdp2xtp2", "fsdp4")):
        path = os.path.join(root, src)
        model, opt = build(src)
        for step in range(2):
            set_grads(model, step)
            opt.step()
        sd = state_dicts(model, opt)
        keys = set(sd["optim"]["state"]) if "state" in sd["optim"] else set(sd["optim"])
        assert any(k.endswith("0.wq.weight.momentum_buffer") for k in keys), sorted(keys)[:5]
        assert any(k.endswith("1.wo.weight.normuon_second_moment") for k in keys), sorted(keys)
        dcp.save(sd, checkpoint_id=path)
        # Where only closeness holds (GPUs), the third step's updates are compared.
        before = None if exact() else snapshot(model, opt)
        set_grads(model, 2)
        opt.step()
        expected = snapshot(model, opt)

        model2, opt2 = build(dst)
        sd2 = state_dicts(model2, opt2)  # creates state (a zero step), then loads over it
        dcp.load(sd2, checkpoint_id=path)
        set_model_state_dict(model2, sd2["model"])
        set_optimizer_state_dict(model2, opt2, sd2["optim"], options=OPTIONS)
        set_grads(model2, 2)
        opt2.step()
        got = snapshot(model2, opt2)
        assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
        for key, value in expected.items():
            muon = key.endswith((".weight", "momentum_buffer", "normuon_second_moment"))
            if before is not None and key.endswith(".weight") and got[key].ndim >= 2:
                rel = update_difference(got[key], value, before[key])
                assert rel <= GPU_UPDATE_RTOL, (
                    f"{src} -> {dst}: the step-3 update of {key} differs from the "
                    f"uninterrupted run's by {rel:.3f} of its norm (tolerance {GPU_UPDATE_RTOL})"
                )
                continue
            if muon and before is None:
                same = torch.equal(got[key], value)
            else:  # AdamW (and momentum on GPUs): vectorized kernels may differ in the last bit
                # across shard sizes
                same = torch.allclose(got[key], value, rtol=1e-6, atol=1e-6)
            diff = (got[key] - value).abs().max().item()
            assert same, f"{src} -> {dst}: {key} differs from the uninterrupted run by {diff}"


@pytest.mark.timeout(300)
def test_dcp_save_fsdp4_load_fsdp2xtp2_and_back(tmp_path):
    run_distributed(job_reshard, 4, str(tmp_path))
