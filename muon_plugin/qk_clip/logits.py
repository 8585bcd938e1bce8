"""The statistic: each query head's largest pre-softmax logit, from the q and k an attention
call already has.

``max_logit_per_head(q, k, scale=..., visible=...)`` computes ``max over (batch, i, j visible)
of scale * q_i . k_j`` per query head, exactly (fp32 products: on CUDA a bf16/fp16 batched
matmul with fp32 output, as the attention kernels accumulate; elsewhere the inputs in fp32), in
query chunks so that its working memory stays under ``chunk_bytes``; never with autograd. It is
the same number whatever attention backend the model runs (SDPA, FlexAttention, varlen), so one
path serves every model; its cost is one extra ``q k^T`` product per attention call (without
the softmax and the ``P V`` product), about a sixth of the attention's forward + backward
matmul FLOPs, half that for causal masks (keys past a chunk's last query are skipped).

Which (query, key) pairs count is a :class:`Visibility`: causal, a FlexAttention ``mask_mod``,
a dense boolean mask, packed documents (varlen ``cu_seqlens``) with an optional window, or
everything. Grouped-query attention: ``k`` may have fewer heads than ``q`` (query head ``h``
uses key head ``h // (Hq / Hk)``, as SDPA's ``enable_gqa`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from muon_plugin.defaults import QK_CLIP_CHUNK_BYTES

__all__ = [
    "Visibility",
    "is_real",
    "max_logit_per_head",
    "outside_dispatch_modes",
    "should_record",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def should_record() -> bool:
    """Whether a forward counts towards the step's statistic: autograd on, not inference mode
    (validation and generation run under ``no_grad`` / ``inference_mode`` and are left out;
    a checkpointed layer's recomputation counts again, which the MAX makes harmless)."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def is_real(t: Tensor) -> bool:
    """Whether ``t`` holds data (not a meta or fake tensor of a tracing / estimating pass)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type != "meta" and not isinstance(t, FakeTensor)


@contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run the statistic outside any active ``TorchDispatchMode``: selective activation
    checkpointing caches the outputs of matmuls it sees (and refuses later in-place changes),
    which for the statistic's logits would be memory never freed; the statistic is no part of
    the model's computation. Under ``torch.compile`` tracing, nothing changes."""
    if torch.compiler.is_compiling():
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _vmap_mask_mod(mask_mod: MaskMod) -> MaskMod:
    """``mask_mod`` over index vectors ``(b[B], h[H], q[C], kv[K]) -> bool[B, H, C, K]``."""
    fn = mask_mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    return torch.vmap(fn, in_dims=(0, None, None, None), out_dims=0)


@dataclass(frozen=True)
class Visibility:
    """Which (query i, key j) pairs an attention call lets through.

    At most one of ``mask_mod``, ``dense`` and ``documents`` is set; ``causal`` and
    ``window`` apply on top (``j <= i + offset``; ``i - left <= j <= i + right``, ``-1`` for
    unbounded). ``offset`` aligns causal masks when there are fewer queries than keys
    (``Lk - Lq`` for bottom-right alignment, 0 for SDPA's top-left).
    """

    causal: bool = False
    offset: int = 0
    mask_mod: MaskMod | None = None
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` (a ``BlockMask``'s)."""
    mask_shape: tuple[int, int] | None = None
    """``(B, H)`` the ``mask_mod`` is defined over (a ``BlockMask``'s first two dims; 1
    broadcasts); None: the batch and query heads of ``q``."""
    dense: Tensor | None = None
    """Boolean ``[B, Lq, Lk]`` or ``[B, 1 or Hq, Lq, Lk]``, True = visible."""
    documents: Tensor | None = None
    """Per token ``[B, L]`` document ids: only pairs of one document are visible."""
    window: tuple[int, int] | None = None

    def key_limit(self, q_stop: int, lk: int) -> int:
        """How many leading keys a chunk of queries ending before ``q_stop`` can see."""
        limit = lk
        if self.causal:
            limit = min(limit, q_stop + self.offset)
        if self.window is not None and self.window[1] >= 0:
            limit = min(limit, q_stop - 1 + self.window[1] + 1)
        return max(limit, 0)

    def chunk(
        self, b: int, hq: int, q_start: int, q_stop: int, lk: int, device: torch.device
    ) -> Tensor | None:
        """Boolean mask ``[B or 1, Hq or 1, C, lk]`` of the queries ``[q_start, q_stop)``
        and the first ``lk`` keys; None when every pair is visible."""
        qi = torch.arange(q_start, q_stop, device=device).view(-1, 1)
        kj = torch.arange(lk, device=device).view(1, -1)
        mask: Tensor | None = None

        def both(m: Tensor) -> Tensor:
            return m if mask is None else mask & m

        if self.causal:
            mask = both((kj <= qi + self.offset).view(1, 1, *qi.shape[:1], lk))
        if self.window is not None:
            left, right = self.window
            inside = torch.ones_like(kj <= qi)
            if left >= 0:
                inside = inside & (kj >= qi - left)
            if right >= 0:
                inside = inside & (kj <= qi + right)
            mask = both(inside.view(1, 1, q_stop - q_start, lk))
        if self.mask_mod is not None:
            fn = _vmap_mask_mod(self.mask_mod)
            mb, mh = self.mask_shape or (b, hq)
            m = fn(
                torch.arange(mb, device=device),
                torch.arange(mh, device=device),
                torch.arange(q_start, q_stop, device=device),
                torch.arange(lk, device=device),
            )
            mask = both(m.to(torch.bool))
        if self.dense is not None:
            dense = self.dense if self.dense.dim() == 4 else self.dense.unsqueeze(1)
            mask = both(dense[:, :, q_start:q_stop, :lk].to(device=device, dtype=torch.bool))
        if self.documents is not None:
            docs = self.documents.to(device)
            same = docs[:, q_start:q_stop, None] == docs[:, None, :lk]
            mask = both(same.unsqueeze(1))
        return mask


def _products(q: Tensor, k_t: Tensor) -> Tensor:
    """``q @ k_t`` (3-D batches) in fp32: bf16/fp16 inputs on CUDA keep their matmul rate and
    accumulate in fp32 as the attention kernels do; other inputs are multiplied in fp32."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(q, k_t, out_dtype=torch.float32)
    return torch.bmm(q.float(), k_t.float())


def max_logit_per_head(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | None = None,
    visible: Visibility | None = None,
    chunk_bytes: int = QK_CLIP_CHUNK_BYTES,
) -> Tensor:
    """Largest ``scale * q_i . k_j`` over the batch and the visible pairs, per query head.

    ``q``: ``[B, Hq, Lq, D]``; ``k``: ``[B, Hk, Lk, D]`` with ``Hq`` a multiple of ``Hk``;
    ``scale`` defaults to ``D ** -0.5``. Returns fp32 ``[Hq]``; ``-inf`` for a head that sees
    no pair. Runs without autograd; no host synchronization.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"max_logit_per_head: q {tuple(q.shape)} and k {tuple(k.shape)} are not "
            "[B, heads, L, D] with the same B and D"
        )
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"max_logit_per_head: {hq} query heads, {hk} key heads")
    rep = hq // hk
    scale = d**-0.5 if scale is None else float(scale)
    visible = visible or Visibility()
    # logits and mask of one chunk: B * Hq * C * Lk * (4 + 1) bytes
    per_query = max(b * hq * lk * 5, 1)
    step = max(1, min(lq, chunk_bytes // per_query))
    best = torch.full((hq,), float("-inf"), dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for start in range(0, lq, step):
            stop = min(lq, start + step)
            keys = visible.key_limit(stop, lk)
            if keys == 0:
                continue
            c = stop - start
            qc = q[:, :, start:stop].reshape(b, hk, rep * c, d).reshape(b * hk, rep * c, d)
            kc = k[:, :, :keys].reshape(b * hk, keys, d).transpose(1, 2)
            logits = _products(qc, kc).view(b, hq, c, keys)
            logits.mul_(scale)
            mask = visible.chunk(b, hq, start, stop, keys, q.device)
            if mask is not None:
                logits.masked_fill_(~mask, float("-inf"))
            torch.maximum(best, logits.amax(dim=(0, 2, 3)), out=best)
    return best
