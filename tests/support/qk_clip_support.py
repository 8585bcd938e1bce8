"""Small attention layers with exactly computable logits, for the QK-Clip tests.

Each layer keeps its projections as plain ``nn.Linear`` s (or one fused weight, or MLA's
split projections) and has a ``logits(x)`` in fp64 that lists every pre-softmax logit
``[B, Hq, L, L]`` (causal pairs only; the rest -inf), from which the max per head is exact.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from muon_plugin.qk_clip import AttentionHeads, fused_qkv, mla, separate_projections


def causal(lq: int, lk: int) -> Tensor:
    return torch.ones(lq, lk, dtype=torch.bool).tril()


def masked(logits: Tensor, visible: Tensor) -> Tensor:
    return logits.masked_fill(~visible, float("-inf"))


def boost_rows(w: Tensor, heads: list[int], rows: int, factor: float) -> None:
    """Scale the rows of ``heads`` (blocks of ``rows``) so their logits grow."""
    with torch.no_grad():
        for h in heads:
            w[h * rows : (h + 1) * rows] *= factor


class GQALayer(nn.Module):
    """Separate wq / wk / wv; ``n_kv`` key heads (GQA when fewer than ``n_heads``)."""

    def __init__(self, dim: int, n_heads: int, n_kv: int, head_dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv * head_dim, bias=False)
        with torch.no_grad():
            for lin in (self.wq, self.wk, self.wv):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.5)

    def heads(self, name: str = "attn") -> AttentionHeads:
        return separate_projections(
            name,
            ("wq.weight", self.wq.weight),
            ("wk.weight", self.wk.weight),
            self.n_heads,
            self.n_kv,
            self.head_dim,
        )

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, seq, _ = x.shape
        q = self.wq(x).view(b, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, seq, -1, self.head_dim).transpose(1, 2)
        return q, k

    def logits(self, x: Tensor) -> Tensor:
        q, k = (t.double() for t in self.qk(x))
        k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        seq = x.shape[1]
        return masked(q @ k.transpose(-1, -2) * self.head_dim**-0.5, causal(seq, seq))


class FusedLayer(nn.Module):
    """One ``wqkv`` weight, rows grouped per key head ([q x rep, k, v]) or stacked."""

    def __init__(self, dim, n_heads, n_kv, head_dim, order: str = "grouped", seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.n_heads, self.n_kv, self.head_dim, self.order = n_heads, n_kv, head_dim, order
        rows = (n_heads + 2 * n_kv) * head_dim
        self.wqkv = nn.Parameter(torch.randn(rows, dim, generator=g) * 0.5)

    def heads(self, name: str = "attn") -> AttentionHeads:
        return fused_qkv(
            name, ("wqkv", self.wqkv), self.n_heads, self.n_kv, self.head_dim, self.order
        )

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, seq, _ = x.shape
        hd, rep = self.head_dim, self.n_heads // self.n_kv
        out = x @ self.wqkv.T
        if self.order == "grouped":
            out = out.view(b, seq, self.n_kv, rep + 2, hd)
            q = out[:, :, :, :rep].reshape(b, seq, self.n_heads, hd)
            k = out[:, :, :, rep]
        else:
            q = out[..., : self.n_heads * hd].reshape(b, seq, self.n_heads, hd)
            k = out[..., self.n_heads * hd : (self.n_heads + self.n_kv) * hd]
            k = k.reshape(b, seq, self.n_kv, hd)
        return q.transpose(1, 2), k.transpose(1, 2)

    def logits(self, x: Tensor) -> Tensor:
        q, k = (t.double() for t in self.qk(x))
        k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        seq = x.shape[1]
        return masked(q @ k.transpose(-1, -2) * self.head_dim**-0.5, causal(seq, seq))


def rotate(t: Tensor) -> Tensor:
    """A fixed per-position rotation of pairs of dims (stands in for rope)."""
    seq, d = t.shape[-2], t.shape[-1]
    pos = torch.arange(seq, dtype=t.dtype).view(-1, 1)
    freq = torch.arange(d // 2, dtype=t.dtype).view(1, -1) + 1.0
    cos, sin = torch.cos(pos * freq * 0.1), torch.sin(pos * freq * 0.1)
    a, b = t[..., 0::2], t[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class MLALayer(nn.Module):
    """DeepSeek-V3's attention without the norms: wq (per head: nope then rope rows), wkv_a
    (latent then the shared rope key), wkv_b (per head: key nope then value rows)."""

    def __init__(self, dim=16, n_heads=4, nope=6, rope=4, v_dim=5, latent=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.n_heads, self.nope, self.rope, self.v_dim, self.latent = (
            n_heads,
            nope,
            rope,
            v_dim,
            latent,
        )
        self.wq = nn.Parameter(torch.randn(n_heads * (nope + rope), dim, generator=g) * 0.5)
        self.wkv_a = nn.Parameter(torch.randn(latent + rope, dim, generator=g) * 0.5)
        self.wkv_b = nn.Parameter(torch.randn(n_heads * (nope + v_dim), latent, generator=g) * 0.5)
        self.scale = (nope + rope) ** -0.5

    def heads(self, name: str = "attn") -> AttentionHeads:
        return mla(
            name,
            ("wq", self.wq),
            ("wkv_b", self.wkv_b),
            self.n_heads,
            self.nope,
            self.rope,
            self.v_dim,
        )

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, seq, _ = x.shape
        q = (x @ self.wq.T).view(b, seq, self.n_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv = x @ self.wkv_a.T
        latent, k_pe = kv.split([self.latent, self.rope], dim=-1)
        kv = (latent @ self.wkv_b.T).view(b, seq, self.n_heads, self.nope + self.v_dim)
        k_nope = kv[..., : self.nope].transpose(1, 2)
        k_pe = rotate(k_pe).unsqueeze(1).expand(-1, self.n_heads, -1, -1)
        return torch.cat([q_nope, rotate(q_pe)], -1), torch.cat([k_nope, k_pe], -1)

    def logits(self, x: Tensor) -> Tensor:
        q, k = (t.double() for t in self.qk(x))
        seq = x.shape[1]
        return masked(q @ k.transpose(-1, -2) * self.scale, causal(seq, seq))


def head_max(logits: Tensor) -> Tensor:
    """``[B, H, Lq, Lk]`` -> per head max."""
    return logits.detach().amax(dim=(0, 2, 3))
