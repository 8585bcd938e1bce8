"""MuonLP on DTensors (gloo, 2 spawned processes, FSDP2): sharded state equals the
single-process state bit for bit, round-trips through DCP, and loads into another layout
(TP-style ``Shard(1)``, and plain tensors in one process)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from lp_support import KWARGS, seed_of
from torch import nn

from muon_plugin.lp import MuonLP
from muon_plugin.lp.keys import W_KEY

pytest.importorskip("torchao")

DIST_DTYPES = ("int8", "int4", "fp8", "bf16")
DIST_SHAPES = {"w1": (128, 512), "w2": (127, 512), "head": (8, 127), "bias": (512,)}


class Bag(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in DIST_SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen) * 0.05))


def bag_groups(named) -> list[dict]:
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    vecs = [(n, p) for n, p in named if p.ndim < 2]
    return [
        {"params": [p for _, p in mats], "param_names": [n for n, _ in mats]},
        {"params": [p for _, p in vecs], "param_names": [n for n, _ in vecs], "algorithm": "adamw"},
    ]


def global_grad(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed_of(name, step))
    return torch.randn(DIST_SHAPES[name], generator=gen)


def set_bag_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = global_grad(name, step)
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.dtype in (torch.uint8, torch.float8_e4m3fn):
        # gloo cannot gather these dtypes: gather the bytes as int8.
        as_int8 = DTensor.from_local(
            t.to_local().view(torch.int8),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
        return as_int8.full_tensor().view(t.dtype)
    return t.full_tensor()


def snapshot(model: nn.Module, opt: MuonLP) -> dict[str, torch.Tensor]:
    out = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if p.ndim >= 2:
            out[f"{n}.momentum"] = full(opt.momentum(p)).clone()
            for key, value in opt.state[p].items():
                out[f"{n}.{key}"] = full(value).clone()
    return out


def assert_same(got: dict, want: dict, label: str) -> None:
    """Equal state and parameters."""
    for key in want:
        tol = 1e-6 if key == "bias" else 0.0  # AdamW's CPU kernels round shard tails differently
        a, b = got[key], want[key]
        ok = torch.equal(a, b) if tol == 0.0 else torch.allclose(a, b, rtol=tol, atol=tol)
        assert ok, f"{label}: {key} differs by {(a.float() - b.float()).abs().max().item()}"


def dist_checkpoint_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_state(model, opt) -> dict:
    """The model and optimizer state as torchtitan hands it to DCP."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = dist_checkpoint_options()
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }


def dcp_save(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(dcp_state(model, opt), checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=dist_checkpoint_options())


def dist_job(rank: int, ws: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    for state_dtype in DIST_DTYPES:
        label = state_dtype
        kwargs = dict(state_dtype=state_dtype, **KWARGS)

        def fsdp_model(seed: int) -> nn.Module:
            model = Bag(seed)
            fully_shard(model, mesh=mesh)
            return model

        # 1. FSDP2 (Shard(0), uneven for w2) against one process fed the gathered gradients.
        model, ref_model = fsdp_model(0), Bag(0)
        opt = MuonLP(bag_groups(list(model.named_parameters())), **kwargs)
        ref = MuonLP(bag_groups(list(ref_model.named_parameters())), **kwargs)
        for step in range(3):
            set_bag_grads(model, step)
            set_bag_grads(ref_model, step)
            opt.step()
            ref.step()
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            fmt = opt.state_format(p)
            assert fmt.kind == ("bf16" if name == "head" else state_dtype), (label, name, fmt)
            for key, value in opt.state[p].items():
                # Sharded like the parameter: same mesh and placements, blocks of its rows
                # (fp8's rank-1 factors: like its rows, u, or replicated like its columns, w).
                assert isinstance(value, DTensor), key
                assert tuple(value.placements) == fmt.placements(p, key), key
                rows = p.to_local().shape[0] if key != W_KEY else p.shape[1]
                assert value.to_local().shape[0] == rows, key
        saved = snapshot(model, opt)
        assert_same(saved, snapshot(ref_model, ref), f"{label} FSDP2 vs one process")

        # 2. DCP save, one more step; a fresh FSDP2 optimizer loads and takes the same step.
        path = os.path.join(root, state_dtype)
        dcp_save(model, opt, path)
        set_bag_grads(model, 3)
        opt.step()
        after = snapshot(model, opt)
        model2 = fsdp_model(1)
        opt2 = MuonLP(bag_groups(list(model2.named_parameters())), **kwargs)
        dcp_load(model2, opt2, path)
        assert_same(snapshot(model2, opt2), saved, f"{label} DCP load")
        set_bag_grads(model2, 3)
        opt2.step()
        assert_same(snapshot(model2, opt2), after, f"{label} step after DCP load")

        # 3. Another layout: every parameter Shard(1) (TP-rowwise-like), loaded from the
        #    FSDP2 checkpoint; blocks run along rows, so codes and scales just move.
        model3 = Bag(2)
        for name, p in list(model3.named_parameters()):
            placement = Shard(1) if p.ndim >= 2 else Shard(0)
            dt = distribute_tensor(p.detach(), mesh, [placement])
            model3.register_parameter(name, nn.Parameter(dt))
        opt3 = MuonLP(bag_groups(list(model3.named_parameters())), **kwargs)
        dcp_load(model3, opt3, path)
        for p in model3.parameters():
            if p.ndim >= 2:
                fmt = opt3.state_format(p)
                for key, value in opt3.state[p].items():
                    assert tuple(value.placements) == fmt.placements(p, key), key
        assert_same(snapshot(model3, opt3), saved, f"{label} Shard(1) load")
        set_bag_grads(model3, 3)
        opt3.step()
        assert_same(snapshot(model3, opt3), after, f"{label} step after Shard(1) load")
        if rank == 0:
            torch.save({"saved": saved, "after": after}, os.path.join(root, f"{state_dtype}.pt"))


def test_fsdp2_dcp_and_layout_change(tmp_path):
    """FSDP2 over 2 gloo ranks: state equals one process's, DCP round trip, other layouts."""
    run_distributed(dist_job, 2, str(tmp_path))
    # And plain tensors in this (non-distributed) process, from the 2-rank FSDP2 checkpoint.
    for state_dtype in DIST_DTYPES:
        expected = torch.load(tmp_path / f"{state_dtype}.pt", weights_only=True)
        model = Bag(3)
        opt = MuonLP(bag_groups(list(model.named_parameters())), state_dtype=state_dtype, **KWARGS)
        with pytest.warns(UserWarning, match="single process"):
            dcp_load(model, opt, str(tmp_path / state_dtype))
        assert_same(snapshot(model, opt), expected["saved"], f"{state_dtype} plain load")
        set_bag_grads(model, 3)
        opt.step()
        assert_same(snapshot(model, opt), expected["after"], f"{state_dtype} plain step")
