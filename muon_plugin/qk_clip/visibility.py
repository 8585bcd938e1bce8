"""Which (query, key) pairs an attention call lets through: :class:`Visibility`, as chunk masks
for the exact chunked statistic and as one FlexAttention ``mask_mod`` for the fused path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["MaskMod", "Visibility"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


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
    block_mask: Any = None
    """The call's own FlexAttention ``BlockMask`` (its ``mask_mod`` is then ``mask_mod``): the
    FlexAttention path uses it as it is."""
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

    def free_keys(self, q_start: int, lk: int) -> int:
        """How many leading keys every query from ``q_start`` on sees (their logits need no
        mask): all of them without a mask, the keys up to the first query's diagonal under a
        plain causal mask, none for the other kinds."""
        if self.window is not None or self.mask_mod is not None:
            return 0
        if self.dense is not None or self.documents is not None:
            return 0
        if not self.causal:
            return lk
        return max(0, min(lk, q_start + self.offset + 1))

    def chunk(
        self,
        b: int,
        hq: int,
        q_start: int,
        q_stop: int,
        lk: int,
        device: torch.device,
        k_start: int = 0,
    ) -> Tensor | None:
        """Boolean mask ``[B or 1, Hq or 1, C, lk - k_start]`` of the queries
        ``[q_start, q_stop)`` and the keys ``[k_start, lk)``; None when every pair is visible."""
        qi = torch.arange(q_start, q_stop, device=device).view(-1, 1)
        kj = torch.arange(k_start, lk, device=device).view(1, -1)
        width = lk - k_start
        mask: Tensor | None = None

        def both(m: Tensor) -> Tensor:
            return m if mask is None else mask & m

        if self.causal:
            mask = both((kj <= qi + self.offset).view(1, 1, *qi.shape[:1], width))
        if self.window is not None:
            left, right = self.window
            inside = torch.ones_like(kj <= qi)
            if left >= 0:
                inside = inside & (kj >= qi - left)
            if right >= 0:
                inside = inside & (kj <= qi + right)
            mask = both(inside.view(1, 1, q_stop - q_start, width))
        if self.mask_mod is not None:
            fn = _vmap_mask_mod(self.mask_mod)
            mb, mh = self.mask_shape or (b, hq)
            m = fn(
                torch.arange(mb, device=device),
                torch.arange(mh, device=device),
                torch.arange(q_start, q_stop, device=device),
                torch.arange(k_start, lk, device=device),
            )
            mask = both(m.to(torch.bool))
        if self.dense is not None:
            dense = self.dense if self.dense.dim() == 4 else self.dense.unsqueeze(1)
            dense = dense[:, :, q_start:q_stop, k_start:lk]
            mask = both(dense.to(device=device, dtype=torch.bool))
        if self.documents is not None:
            docs = self.documents.to(device)
            same = docs[:, q_start:q_stop, None] == docs[:, None, k_start:lk]
            mask = both(same.unsqueeze(1))
        return mask

    def flex_mask_mod(self, hq: int) -> MaskMod | None:
        """The visibility as one FlexAttention ``mask_mod`` (None: everything visible); dense
        masks and documents become index lookups."""
        mods: list[MaskMod] = []
        if self.causal:
            offset = self.offset
            mods.append(lambda b, h, i, j: j <= i + offset)
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                mods.append(lambda b, h, i, j: j >= i - left)
            if right >= 0:
                mods.append(lambda b, h, i, j: j <= i + right)
        if self.mask_mod is not None:
            mods.append(self.mask_mod)
        if self.dense is not None:
            dense = self.dense if self.dense.dim() == 4 else self.dense.unsqueeze(1)
            dense = dense.to(torch.bool)
            per_head = dense.shape[1] > 1
            mods.append(lambda b, h, i, j: dense[b, h if per_head else 0, i, j])
        if self.documents is not None:
            docs = self.documents
            mods.append(lambda b, h, i, j: docs[b, i] == docs[b, j])
        if not mods:
            return None
        if len(mods) == 1:
            return mods[0]

        def both(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            out = mods[0](b, h, i, j)
            for mod in mods[1:]:
                out = out & mod(b, h, i, j)
            return out

        return both
