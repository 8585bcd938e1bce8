"""Published model shapes, and the layouts torchtitan gives them, as the planner's inputs.

A :class:`Model` is its Muon matrices (one entry per parameter, with torchtitan's shapes: a
linear layer ``[out, in]``, an expert stack ``[experts, out, in]``) and the count of its other
parameters (embeddings, output head, norms, routers: AdamW). The values come from each model's
published ``config.json``:

- Llama-3 8B / 70B (meta-llama/Meta-Llama-3-8B, -70B) and Llama-3.1 405B
  (meta-llama/Llama-3.1-405B): hidden 4096 / 8192 / 16384, intermediate 14336 / 28672 / 53248,
  layers 32 / 80 / 126, heads 32 / 64 / 128, KV heads 8, vocabulary 128256.
- DeepSeek-V3 (deepseek-ai/DeepSeek-V3): hidden 7168, 61 layers of which the first 3 dense
  (intermediate 18432), 256 routed experts (intermediate 2048, 8 per token) and 1 shared, 128
  heads, MLA with q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128,
  vocabulary 129280 (the multi-token-prediction layer is not counted: torchtitan does not
  train it).
- Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): hidden 2048, 48 layers, all MoE: 128 experts
  (intermediate 768, 8 per token), 32 heads and 4 KV heads of 128, vocabulary 151936, untied.

:func:`entries` lays a model out on ``n`` simulated ranks the way torchtitan 0.2.2's
parallelize functions do (the placements are those checked on real meshes in
``tests/distributed/test_expert_parallel.py`` and ``tests/distributed/test_distributed.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

NODE = 8
"""GPUs per node: the TP degree and the NVLink domain of the cost model."""

HSDP_SHARD = 64
"""Ranks of one HSDP shard group (8 nodes); the groups replicate each other."""


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter: name, global shape, and its TP style (colwise shards the rows)."""

    name: str
    shape: tuple[int, ...]
    colwise: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def expert(self) -> bool:
        return len(self.shape) == 3


@dataclass(frozen=True)
class Model:
    name: str
    matrices: tuple[Matrix, ...]
    other_params: int  # AdamW: embeddings, head, norms, routers
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0

    @property
    def muon_params(self) -> int:
        return sum(m.numel for m in self.matrices)

    @property
    def params(self) -> int:
        return self.muon_params + self.other_params

    @property
    def active_params(self) -> int:
        """Parameters a token uses: all but the routed experts it is not sent to."""
        routed = sum(m.numel for m in self.matrices if m.expert)
        if not routed:
            return self.params
        return self.params - routed + routed * self.experts_per_token // self.experts


def llama3(name: str, dim: int, ffn: int, layers: int, heads: int, vocab: int) -> Model:
    hd, kv = dim // heads, 8
    layer = [
        ("wq", (heads * hd, dim), True),
        ("wk", (kv * hd, dim), True),
        ("wv", (kv * hd, dim), True),
        ("wo", (dim, heads * hd), False),
        ("w1", (ffn, dim), True),
        ("w2", (dim, ffn), False),
        ("w3", (ffn, dim), True),
    ]
    mats = tuple(Matrix(f"layers.{i}.{n}", s, c) for i in range(layers) for n, s, c in layer)
    other = 2 * vocab * dim + (2 * layers + 1) * dim
    return Model(name, mats, other)


def deepseek_v3() -> Model:
    dim, layers, dense, heads, vocab = 7168, 61, 3, 128, 129280
    q_rank, kv_rank, nope, rope, v = 1536, 512, 128, 64, 128
    experts, expert_ffn = 256, 2048
    mats = []
    for i in range(layers):
        p = f"layers.{i}."
        mats += [
            Matrix(p + "attention.wq_a", (q_rank, dim)),
            Matrix(p + "attention.wq_b", (heads * (nope + rope), q_rank)),
            Matrix(p + "attention.wkv_a", (kv_rank + rope, dim)),
            Matrix(p + "attention.wkv_b", (heads * (nope + v), kv_rank)),
            Matrix(p + "attention.wo", (dim, heads * v), False),
        ]
        if i < dense:
            ffn = 18432
            mats += [Matrix(p + "w1", (ffn, dim)), Matrix(p + "w2", (dim, ffn), False)]
            mats += [Matrix(p + "w3", (ffn, dim))]
            continue
        for n, s, c in (("w1", (expert_ffn, dim), True), ("w2", (dim, expert_ffn), False),
                        ("w3", (expert_ffn, dim), True)):  # fmt: skip
            mats.append(Matrix(p + "moe.experts." + n, (experts, *s), c))
            mats.append(Matrix(p + "moe.shared_experts." + n, s, c))  # 1 shared expert
    norms = layers * (2 * dim + q_rank + kv_rank) + dim
    routers = (layers - dense) * experts * dim
    return Model("DeepSeek-V3", tuple(mats), 2 * vocab * dim + norms + routers, experts, 8)


def qwen3_30b_a3b() -> Model:
    dim, layers, heads, kv, hd, vocab = 2048, 48, 32, 4, 128, 151936
    experts, expert_ffn = 128, 768
    mats = []
    for i in range(layers):
        p = f"layers.{i}."
        mats += [
            Matrix(p + "attention.wq", (heads * hd, dim)),
            Matrix(p + "attention.wk", (kv * hd, dim)),
            Matrix(p + "attention.wv", (kv * hd, dim)),
            Matrix(p + "attention.wo", (dim, heads * hd), False),
            Matrix(p + "moe.experts.w1", (experts, expert_ffn, dim)),
            Matrix(p + "moe.experts.w2", (experts, dim, expert_ffn), False),
            Matrix(p + "moe.experts.w3", (experts, expert_ffn, dim)),
        ]
    other = 2 * vocab * dim + layers * (2 * dim + 2 * hd + experts * dim) + dim
    return Model("Qwen3-30B-A3B", tuple(mats), other, experts, 8)


MODELS = {
    "llama3-8b": lambda: llama3("Llama-3 8B", 4096, 14336, 32, 32, 128256),
    "llama3-70b": lambda: llama3("Llama-3 70B", 8192, 28672, 80, 64, 128256),
    "llama3-405b": lambda: llama3("Llama-3.1 405B", 16384, 53248, 126, 128, 128256),
    "deepseek-v3": deepseek_v3,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}

LAYOUTS = ("fsdp", "fsdp_tp", "hsdp", "ep")


def placements(m: Matrix, layout: str, n: int, ep: int, experts: int):
    """``(mesh shape, placements)`` of ``m`` on ``n`` ranks laid out as torchtitan 0.2.2 does.

    - ``fsdp``: FSDP2 over all ranks, ``Shard(0)`` (expert stacks: on the expert dim);
    - ``fsdp_tp``: TP over a node (``NODE`` ranks) inside FSDP: colwise
      ``(_StridedShard(0, NODE), Shard(0))``, rowwise ``(Shard(0), Shard(1))``;
    - ``hsdp``: FSDP inside groups of ``HSDP_SHARD`` ranks, replicated over ``n / HSDP_SHARD``;
    - ``ep``: expert stacks on the ``(efsdp, ep)`` mesh (``efsdp = n / ep``): EP shards the
      experts, FSDP shards them again on the expert dim, or inside the matrix (``Shard(1)``)
      once ``n`` exceeds the experts; every other matrix FSDP over all ranks.
    """
    if layout == "fsdp" or (layout == "ep" and not m.expert):
        return (n,), (Shard(0),)
    if layout == "fsdp_tp":
        if m.expert:
            raise ValueError("fsdp_tp is for dense models here (MoE models use ep)")
        tp = (_StridedShard(0, split_factor=NODE), Shard(0)) if m.colwise else (Shard(0), Shard(1))
        return (n // NODE, NODE), tp
    if layout == "hsdp":
        return (n // HSDP_SHARD, HSDP_SHARD), (Replicate(), Shard(0))
    if layout == "ep":
        if n % ep:
            raise ValueError(f"{n} ranks are not a multiple of EP {ep}")
        inside = n > experts  # efsdp x ep > experts: torchtitan shards dim 1
        fsdp = Shard(1) if inside else _StridedShard(0, split_factor=ep)
        return (n // ep, ep), (fsdp, Shard(0))
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def entries(model: Model, layout: str, n: int, spec, ep: int = 1) -> list[tuple]:
    """The planner's ``(global shape, mesh shape, placements, spec)`` of every Muon matrix."""
    out = []
    for m in model.matrices:
        mesh, where = placements(m, layout, n, ep, model.experts)
        out.append((m.shape, mesh, where, spec))
    return out


def local_fraction(layout: str, n: int) -> float:
    """The share of every parameter one rank holds (its elementwise work)."""
    return 1 / HSDP_SHARD if layout == "hsdp" else 1 / n
