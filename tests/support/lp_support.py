"""Shared by the MuonLP tests: a small model whose matrices every format quantizes, param
groups, seeded gradients, error measures and plain state tensors of a format."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from muon_plugin.lp import MomentumCodec

DTYPES = ("bf16", "int8", "int4", "fp8")
KWARGS = dict(lr=0.02, wd=0.01)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def mlp(seed: int = 0) -> nn.Sequential:
    """Three Muon matrices that every state dtype quantizes (>= 4096 elements, 256 columns)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16)
    )


def groups(model: nn.Module) -> list[dict]:
    """Muon for the matrices, AdamW for the rest, both named."""
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    vecs = [(n, p) for n, p in named if p.ndim < 2]
    return [
        {"params": [p for _, p in mats], "param_names": [n for n, _ in mats]},
        {"params": [p for _, p in vecs], "param_names": [n for n, _ in vecs], "algorithm": "adamw"},
    ]


def random_grads(params, step: int) -> None:
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(seed_of(i, step))
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def muon_params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]


def zero_state(codec: MomentumCodec, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Zero-filled plain state tensors of ``codec`` for a parameter of ``shape``."""
    return {k: torch.zeros(s, dtype=d) for k, (s, d) in codec.layout(shape).items()}


def roundtrip(codec: MomentumCodec, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(decoded x, the state tensors) after encoding ``x`` with ``codec``."""
    state = zero_state(codec, tuple(x.shape))
    codec.encode_(state, x)
    return codec.decode(state, tuple(x.shape)), state


def bf16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 >= x (fp32, x >= 0), as bf16."""
    up = x.to(torch.bfloat16)
    return torch.where(up.float() < x, up.nextafter(up.new_tensor(math.inf)), up)
