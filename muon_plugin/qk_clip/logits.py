"""The statistic: each query head's largest pre-softmax logit, from the q and k an attention
call already has.

``max_logit_per_head(q, k, scale=..., visible=...)`` computes ``max over (batch, i, j visible)
of scale * q_i . k_j`` per query head, never with autograd, the same number whatever attention
backend the model runs (SDPA, FlexAttention, varlen), by one of two paths:

- on CUDA (torch with FlexAttention's ``max_scores``): one compiled FlexAttention forward over
  ``q``, ``k`` and a zero ``V`` 16 wide, asking for its per-row max scores (fp32, after the
  scale), with the call's own ``BlockMask`` or one built for it (causal masks cached). Fused: the
  logits never leave the chip; it costs the ``q k^T`` product and the softmax's exponentials of
  one attention forward (about a seventh of the attention's forward + backward FLOPs);
- elsewhere (and as the fallback): the products in query chunks (fp32: a bf16/fp16 batched
  matmul with fp32 output on CUDA, else the inputs in fp32), masked and reduced chunk by chunk so
  that the working memory stays under ``chunk_bytes``; keys past a chunk's last query are
  skipped under causal masks. Exact, but each chunk's logits pass through memory.

``flex=False`` keeps a call on the chunked path; :class:`~muon_plugin.qk_clip.QKClip` reads
the documented override ``MUON_PLUGIN_QK_CLIP_FLEX=0`` once, when it is built
(:func:`flex_from_env`), and names the path in its build line (:func:`statistic_path`).

Which (query, key) pairs count is a :class:`~muon_plugin.qk_clip.visibility.Visibility`
(its own module): causal, a FlexAttention ``mask_mod``,
a dense boolean mask, packed documents (varlen ``cu_seqlens``) with an optional window, or
everything. Grouped-query attention: ``k`` may have fewer heads than ``q`` (query head ``h``
uses key head ``h // (Hq / Hk)``, as SDPA's ``enable_gqa`` does).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from muon_plugin.defaults import QK_CLIP_CHUNK_BYTES
from muon_plugin.qk_clip.visibility import Visibility

__all__ = [
    "flex_from_env",
    "is_real",
    "max_logit_per_head",
    "outside_dispatch_modes",
    "should_record",
    "statistic_path",
]

logger = logging.getLogger(__name__)

FLEX_ENV = "MUON_PLUGIN_QK_CLIP_FLEX"
FLEX_V_DIM = 16
"""The width of the zero ``V`` of the FlexAttention path (its ``P V`` product is that narrow)."""


def should_record() -> bool:
    """Whether a forward counts towards the step's statistic: autograd on, not inference mode
    (validation and generation run under ``no_grad`` / ``inference_mode`` and are left out;
    a checkpointed layer's recomputation counts again, which the MAX makes harmless). Under
    ``torch.compile`` only autograd is asked: dynamo cannot trace the inference-mode query
    (torchtitan compiles each block with ``fullgraph=True``, where that break is an error), and
    it does not trace code under ``inference_mode`` anyway."""
    if torch.compiler.is_compiling():
        return torch.is_grad_enabled()
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def is_real(t: Tensor) -> bool:
    """Whether ``t`` holds data (not a meta or fake tensor of a tracing / estimating pass;
    under ``torch.compile`` tracing, every tensor stands for data)."""
    if torch.compiler.is_compiling():
        return True
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


_flex_state: dict[str, Any] = {}


def flex_from_env() -> bool:
    """The documented override: ``MUON_PLUGIN_QK_CLIP_FLEX=0`` turns the FlexAttention path
    off (read once, by whoever builds the statistic's user)."""
    return os.environ.get(FLEX_ENV, "1") != "0"


def statistic_path(device: torch.device, flex: bool) -> str:
    """Which path the statistic takes on ``device``, for the build log (a call traced by
    ``torch.compile``, or any call after the Flex path failed with its one warning, takes the
    chunked path whatever this says)."""
    if device.type != "cuda":
        return "chunked q.k products"
    if not flex:
        return f"chunked q.k products ({FLEX_ENV}=0)"
    if not flex_returns_max_scores():
        return "chunked q.k products (this torch's FlexAttention has no max_scores)"
    return "fused FlexAttention max_scores"


def _flex_available(q: Tensor, flex: bool = True) -> bool:
    """Whether the FlexAttention path serves ``q``: asked for, CUDA, a torch whose
    FlexAttention returns max scores, not failed before, and not inside ``torch.compile``
    tracing (which takes the chunked path)."""
    if not (flex and q.is_cuda) or _flex_state.get("failed"):
        return False
    if torch.compiler.is_compiling():
        return False
    return flex_returns_max_scores()


@functools.cache
def flex_returns_max_scores() -> bool:
    """Whether this torch's FlexAttention can return its per-row max scores (``AuxRequest``,
    a ``NamedTuple``, has the ``max_scores`` field); asked once per process, not per attention
    call."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return False
    return "max_scores" in getattr(AuxRequest, "_fields", ())


def _flex_block_mask(visible: Visibility, b: int, hq: int, lq: int, lk: int, device) -> Any:
    """The ``BlockMask`` of ``visible`` for these sizes: the call's own, a cached causal (or
    all-visible) one, or one built for the call (compiled ``create_block_mask``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if visible.block_mask is not None:
        return visible.block_mask
    plain = visible.mask_mod is None and visible.dense is None and visible.documents is None
    key = (visible.causal, visible.offset, visible.window, lq, lk, str(device))
    cache = _flex_state.setdefault("masks", {})
    if plain and key in cache:
        return cache[key]
    mod = visible.flex_mask_mod(hq) or (lambda bb, h, i, j: i >= 0)
    if visible.mask_mod is not None and visible.mask_shape is not None:
        mb, mh = visible.mask_shape
    elif visible.dense is not None or visible.documents is not None:
        mb, mh = b, None
    else:
        mb, mh = None, None
    if "create" not in _flex_state:
        _flex_state["create"] = torch.compile(create_block_mask)
    mask = _flex_state["create"](mod, mb, mh, lq, lk, device=device)
    if plain:
        if len(cache) >= 8:
            cache.pop(next(iter(cache)))
        cache[key] = mask
    return mask


def _flex_max(q: Tensor, k: Tensor, scale: float, visible: Visibility) -> Tensor | None:
    """The max logit per query head through one compiled FlexAttention forward with a zero
    ``V`` (its ``max_scores``); None when that fails (then never tried again, with a warning)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    b, hq, lq, _ = q.shape
    hk, lk = k.shape[1], k.shape[2]
    try:
        block_mask = _flex_block_mask(visible, b, hq, lq, lk, q.device)
        if "flex" not in _flex_state:
            # fullgraph: past torch's recompile limit the call raises (then the chunked path)
            # instead of running FlexAttention unfused, which materializes every score
            _flex_state["flex"] = torch.compile(flex_attention, fullgraph=True)
        v = q.new_zeros(b, hk, lk, FLEX_V_DIM)
        _, aux = _flex_state["flex"](
            q,
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=hq != hk,
            return_aux=AuxRequest(max_scores=True),
        )
        return aux.max_scores.float().amax(dim=(0, 2))
    except Exception as e:  # any unsupported shape or torch: the exact chunked path instead
        _flex_state["failed"] = True
        why = (
            "torch.compile's recompile limit was reached: more attention shapes, dtypes or mask "
            "kinds than it keeps"
            if type(e).__name__ == "FailOnRecompileLimitHit"
            else repr(e)
        )
        logger.warning(
            f"QK-Clip: the FlexAttention max-logit path failed ({why}); every attention call "
            f"uses the chunked path from now on (set {FLEX_ENV}=0 to choose it from the start)"
        )
        return None


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
    flex: bool = True,
) -> Tensor:
    """Largest ``scale * q_i . k_j`` over the batch and the visible pairs, per query head.

    ``q``: ``[B, Hq, Lq, D]``; ``k``: ``[B, Hk, Lk, D]`` with ``Hq`` a multiple of ``Hk``;
    ``scale`` defaults to ``D ** -0.5``; ``flex=False``: the chunked path even on CUDA.
    Returns fp32 ``[Hq]``; ``-inf`` for a head that sees no pair. Runs without autograd; no
    host synchronization.
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
    if _flex_available(q, flex):
        with torch.no_grad():
            best = _flex_max(q, k, scale, visible)
        if best is not None:
            return best
    # logits and mask of one chunk: B * Hq * C * Lk * (4 + 1) bytes
    per_query = max(b * hq * lk * 5, 1)
    step = max(1, min(lq, chunk_bytes // per_query))
    best = torch.full((hq,), float("-inf"), dtype=torch.float32, device=q.device)
    # fl(scale * x) is monotone in x for scale > 0: the scale applied once to each head's
    # maximum gives the same fp32 number as scaling every logit first
    scale_last = scale > 0
    with torch.no_grad():
        for start in range(0, lq, step):
            stop = min(lq, start + step)
            keys = visible.key_limit(stop, lk)
            if keys == 0:
                continue
            c = stop - start
            qc = q[:, :, start:stop].reshape(b, hk, rep * c, d).reshape(b * hk, rep * c, d)
            free = min(visible.free_keys(start, keys), keys)
            for k0, k1 in ((0, free), (free, keys)):  # keys all queries see, then the rest
                if k1 == k0:
                    continue
                kc = k[:, :, k0:k1].reshape(b * hk, k1 - k0, d).transpose(1, 2)
                logits = _products(qc, kc).view(b, hq, c, k1 - k0)
                if not scale_last:
                    logits.mul_(scale)
                mask = None if k0 < free else visible.chunk(b, hq, start, stop, k1, q.device, k0)
                if mask is not None:
                    logits.masked_fill_(~mask, float("-inf"))
                torch.maximum(best, logits.amax(dim=(0, 2, 3)), out=best)
    return best.mul_(scale) if scale_last else best
