"""QK-Clip on real FSDP2 / TP / FSDP x TP / HSDP parameters (gloo, world sizes 2 and 4).

Three attention layers (GQA with biases, a fused grouped QKV weight, MLA) are sharded like
torchtitan shards them (``fully_shard`` on the data-parallel mesh, column-parallel ``wq`` /
``wk`` / ``wqkv`` / ``wq`` + ``wkv_b`` on "tp"). Every data-parallel rank records the max logits
of its own batch slice (its tensor-parallel ranks: their heads only), so ranks see different
maxima, and a head below tau on one rank's data can be above it on another's. After
``QKClip.step`` (one MAX all-reduce over the data-parallel ranks):

- every rank holds the same factors;
- the gathered parameters equal, bit for bit, a single-process clip of the whole batch (the
  factors come from the same exact maxima, and each element takes one multiply);

for both GQA rules. Shards include uneven ones and an empty one (``wk``: 6 rows over 4 ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import device, device_type, run_distributed
from qk_clip_support import rotate
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from muon_plugin.qk_clip import QKClip, Visibility, fused_qkv, mla, separate_projections

DIM, SEQ = 8, 6
GQA = dict(n_heads=8, n_kv=2, hd=3)
FUSED = dict(n_heads=4, n_kv=2, hd=2)
MLA = dict(n_heads=4, nope=3, rope=2, v=2, latent=5)
CAUSAL = Visibility(causal=True)


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        g, f, m = GQA, FUSED, MLA
        self.gqa = nn.ModuleDict(
            {
                "wq": nn.Linear(DIM, g["n_heads"] * g["hd"]),
                "wk": nn.Linear(DIM, g["n_kv"] * g["hd"]),
            }
        )
        rows = f["n_kv"] * (f["n_heads"] // f["n_kv"] + 2) * f["hd"]
        self.fused = nn.ModuleDict({"wqkv": nn.Linear(DIM, rows, bias=False)})
        self.mla = nn.ModuleDict(
            {
                "wq": nn.Linear(DIM, m["n_heads"] * (m["nope"] + m["rope"]), bias=False),
                "wkv_a": nn.Linear(DIM, m["latent"] + m["rope"], bias=False),
                "wkv_b": nn.Linear(m["latent"], m["n_heads"] * (m["nope"] + m["v"]), bias=False),
            }
        )
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(4.0)

    def heads(self) -> list:
        def w(mod, name, what="weight"):
            return (f"{name}.{what}", getattr(mod, what))

        g, f, m = GQA, FUSED, MLA
        biases = [
            ("gqa.wq.bias", self.gqa["wq"].bias, "q"),
            ("gqa.wk.bias", self.gqa["wk"].bias, "k"),
        ]
        return [
            separate_projections(
                "gqa",
                w(self.gqa["wq"], "gqa.wq"),
                w(self.gqa["wk"], "gqa.wk"),
                g["n_heads"],
                g["n_kv"],
                g["hd"],
                biases,
            ),
            fused_qkv(
                "fused", w(self.fused["wqkv"], "fused.wqkv"), f["n_heads"], f["n_kv"], f["hd"]
            ),
            mla(
                "mla",
                w(self.mla["wq"], "mla.wq"),
                w(self.mla["wkv_b"], "mla.wkv_b"),
                m["n_heads"],
                m["nope"],
                m["rope"],
                m["v"],
            ),
        ]


def qk_all(
    full: dict[str, torch.Tensor], x: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the full q ``[B, Hq, L, D]`` and k ``[B, Hk, L, D]`` from full weights."""
    b, seq, _ = x.shape
    g, f, m = GQA, FUSED, MLA
    q = (x @ full["gqa.wq.weight"].T + full["gqa.wq.bias"]).view(b, seq, -1, g["hd"])
    k = (x @ full["gqa.wk.weight"].T + full["gqa.wk.bias"]).view(b, seq, -1, g["hd"])
    out = [(q.transpose(1, 2), k.transpose(1, 2))]
    rep = f["n_heads"] // f["n_kv"]
    qkv = (x @ full["fused.wqkv.weight"].T).view(b, seq, f["n_kv"], rep + 2, f["hd"])
    q = qkv[:, :, :, :rep].reshape(b, seq, f["n_heads"], f["hd"])
    out.append((q.transpose(1, 2), qkv[:, :, :, rep].transpose(1, 2)))
    q = (x @ full["mla.wq.weight"].T).view(b, seq, m["n_heads"], -1).transpose(1, 2)
    q_nope, q_pe = q.split([m["nope"], m["rope"]], dim=-1)
    latent, k_pe = (x @ full["mla.wkv_a.weight"].T).split([m["latent"], m["rope"]], dim=-1)
    kv = (latent @ full["mla.wkv_b.weight"].T).view(b, seq, m["n_heads"], -1)
    k_nope = kv[..., : m["nope"]].transpose(1, 2)
    k_pe = rotate(k_pe).unsqueeze(1).expand(-1, m["n_heads"], -1, -1)
    out.append((torch.cat([q_nope, rotate(q_pe)], -1), torch.cat([k_nope, k_pe], -1)))
    return out


def batch(dp_rank: int) -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(100 + dp_rank))


TP_PLAN = {
    "gqa.wq": ColwiseParallel(),
    "gqa.wk": ColwiseParallel(),
    "fused.wqkv": ColwiseParallel(),
    "mla.wq": ColwiseParallel(),
    "mla.wkv_b": ColwiseParallel(),
}


def shard(model: Layers, layout: str, ws: int):
    """Shard ``model`` as ``layout``; returns (data-parallel group, dp rank, dp size)."""
    if layout == "fsdp":
        mesh = init_device_mesh(device_type(), (ws,), mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
        return mesh.get_group(), mesh.get_local_rank(), ws
    if layout == "tp":
        mesh = init_device_mesh(device_type(), (ws,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, TP_PLAN)
        return None, 0, 1
    if layout == "fsdp_tp":
        mesh = init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], TP_PLAN)
        fully_shard(model, mesh=mesh["dp"])
        return mesh["dp"].get_group(), mesh["dp"].get_local_rank(), 2
    if layout == "hsdp":  # replicas x shards: the data-parallel ranks are all of them
        mesh = init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("rep", "shard"))
        fully_shard(model, mesh=mesh)
        return dist.group.WORLD, dist.get_rank(), ws
    raise ValueError(layout)


def full_of(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def clip_layout(rank: int, ws: int, layout: str, rule: str) -> None:
    model = Layers().to(device())
    reference = copy.deepcopy(model)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    group, dp_rank, dp_size = shard(model, layout, ws)
    # the single-process reference sees every data-parallel rank's batch
    ref_clip = QKClip(reference.heads(), tau=1e30, gqa_rule=rule)
    for d in range(dp_size):
        for i, (q, k) in enumerate(qk_all(full, batch(d).to(device()))):
            ref_clip.record(i, q, k, visible=CAUSAL)
    whole = ref_clip._running.clone()
    tau = float(whole.median())
    ref_clip.rule.tau = tau

    clip = QKClip(model.heads(), tau=tau, gqa_rule=rule, group=group)
    for i, (q, k) in enumerate(qk_all(full, batch(dp_rank).to(device()))):
        r = clip.ranges[i]
        q = q[:, r.q_start : r.q_start + r.n_q]
        k = k[:, r.k_start : r.k_start + r.n_kv]
        clip.record(i, q, k, visible=CAUSAL)
    mine = clip._running.clone()
    clip.step()
    ref_clip.step()

    # this rank saw its own maxima; after the MAX every rank holds the same factors
    factors = clip.rule.factors(clip.last_max)
    gathered = [torch.empty_like(factors) for _ in range(ws)]
    dist.all_gather(gathered, factors)
    if layout != "tp" and layout != "fsdp_tp":
        assert all(torch.equal(f, factors) for f in gathered), layout
        below_here = (mine <= tau) & (clip.last_max > tau)
        flags = [torch.zeros(1, dtype=torch.int64, device=device()) for _ in range(ws)]
        dist.all_gather(flags, below_here.any().long().view(1))
        assert any(int(f) for f in flags), "no rank saw a clipped head below tau on its own data"
    for name, p in model.named_parameters():
        ref = dict(reference.named_parameters())[name]
        assert torch.equal(full_of(p), ref.detach()), (layout, rule, name)
    moved = [n for n, p in reference.named_parameters() if not torch.equal(p, full[n])]
    assert moved, "the reference clipped nothing"


def job(rank: int, ws: int, layouts: tuple[str, ...]) -> None:
    torch.set_grad_enabled(True)
    for layout in layouts:
        for rule in ("query", "group"):
            clip_layout(rank, ws, layout, rule)


@pytest.mark.timeout(300)
def test_qk_clip_layouts_world2() -> None:
    run_distributed(job, 2, ("fsdp", "tp"))


@pytest.mark.timeout(300)
def test_qk_clip_layouts_world4() -> None:
    run_distributed(job, 4, ("fsdp", "fsdp_tp", "hsdp"))
