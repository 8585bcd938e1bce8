"""QK-Clip on torchtitan 0.3: the attention modules of its models, described for
:mod:`muon_plugin.qk_clip`.

0.3's attention modules call an ``inner_attention`` (``FlexAttention``, ``VarlenAttention``,
``ScaledDotProductAttention``) with ``q`` and ``k`` as ``[B, L, heads, D]`` after rope (and
qk-norm) and the masks as ``attention_masks``: a forward pre-hook there records the max logit
per head with the call's scale and mask (the ``BlockMask``'s ``mask_mod``; varlen's packed
documents and window; SDPA's causal flag). Rows:

- ``GQAttention`` (llama3, qwen3, ...) and gpt_oss's ``Attention``: ``qkv_linear`` is a
  ``QKVLinear`` (``wq`` / ``wk``, biases included) or a ``FusedQKVLinear`` (one ``wqkv``, per
  key head its query heads, its key, its value: 0.3's llama3 debug model);
- deepseek_v3's ``Attention`` (MLA): ``wq`` or ``wq_b``, ``wkv_b``; the shared rope key in
  ``wkv_a`` is never touched.

Refused at build time, with the module's name and the way out: qk-norm (qwen3), other
attention classes or inner-attention types, context parallelism. The data- and
context-parallel group comes from the run's ``ParallelDims`` (its ``loss`` mesh), which
:func:`remember_parallel_dims` records as torchtitan builds it (the container's config installs
that when it is created, before the trainer starts).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from muon_plugin.adapter.qk_clip import QKClipRefused, Recorder
from muon_plugin.qk_clip import AttentionHeads, Visibility, fused_qkv, mla, separate_projections
from muon_plugin.torchtitan.qk_clip import (
    WAY_OUT,
    documents_of,
    inner_attention_check,
    inner_attention_describer,
    qk_clip_group,
    qk_norm_refused,
    unknown_attention_refused,
)

__all__ = [
    "describe_attention",
    "qk_clip_group",
    "remember_parallel_dims",
    "remembered_parallel_dims",
]

INNER_ATTENTIONS = ("FlexAttention", "VarlenAttention", "ScaledDotProductAttention")

_MARK = "_muon_plugin_hook"
_parallel_dims: list[Any] = []


def remember_parallel_dims() -> None:
    """Record every ``ParallelDims`` torchtitan builds (``ParallelDims.from_config``), so the
    optimizer container, which torchtitan builds without it, finds the run's meshes
    (idempotent)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    original = ParallelDims.__dict__["from_config"]
    if getattr(original.__func__, _MARK, False):
        return

    @functools.wraps(original.__func__)
    def from_config(cls: Any, *args: Any, **kwargs: Any) -> Any:
        dims = original.__func__(cls, *args, **kwargs)
        _parallel_dims[:] = [dims]
        return dims

    setattr(from_config, _MARK, True)
    ParallelDims.from_config = classmethod(from_config)


def remembered_parallel_dims() -> Any:
    """The last ``ParallelDims`` torchtitan built in this process, or None."""
    return _parallel_dims[0] if _parallel_dims else None


def _visibility(fqn: str, inner: nn.Module, q: Any, kwargs: dict) -> Visibility:
    from torch.nn.attention.flex_attention import BlockMask

    kind = type(inner).__name__
    masks = kwargs.get("attention_masks")
    if kind == "ScaledDotProductAttention":
        return Visibility(causal=kwargs.get("is_causal", True))
    if kind == "VarlenAttention":
        b, seq = q.shape[0], q.shape[1]
        left, right = inner.window_size
        return Visibility(
            documents=documents_of(masks.cu_seq_q, b, seq),
            causal=right == 0,
            window=None if (left, right) in ((-1, 0), (-1, -1)) else (left, right),
        )
    if kwargs.get("score_mod") is not None:
        raise QKClipRefused(
            f"QK-Clip: {fqn}: FlexAttention with a score_mod changes the logits; QK-Clip "
            f"records q.k only: {WAY_OUT}"
        )
    if not isinstance(masks, BlockMask):
        raise QKClipRefused(
            f"QK-Clip: {fqn}: FlexAttention was called with a {type(masks).__name__} as its "
            f"mask, not a BlockMask: {WAY_OUT}"
        )
    batch, heads = masks.kv_num_blocks.shape[:2]
    return Visibility(mask_mod=masks.mask_mod, mask_shape=(batch, heads), block_mask=masks)


check_inner = inner_attention_check(
    INNER_ATTENTIONS, "FlexAttention, VarlenAttention and ScaledDotProductAttention"
)


def visibility_hook(fqn: str, inner: nn.Module, record: Recorder) -> Any:
    """Hook ``record`` into a torchtitan 0.3 ``inner_attention`` (q, k as ``[B, L, N, D]``)."""
    check_inner(fqn, inner)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        q, k = args[0], args[1]
        visible = _visibility(fqn, module, q, kwargs)
        record(q.transpose(1, 2), k.transpose(1, 2), scale=kwargs.get("scale"), visible=visible)

    return inner.register_forward_pre_hook(hook, with_kwargs=True)


def _merge(fqn: str, parts: list[AttentionHeads]) -> AttentionHeads:
    first = parts[0]
    blocks = tuple(b for p in parts for b in p.blocks)
    return AttentionHeads(fqn, first.n_heads, first.n_kv_heads, blocks)


def _qkv_heads(fqn: str, module: nn.Module, n_heads: int, n_kv: int, head_dim: int):
    qkv = module.qkv_linear
    name = f"{fqn}.qkv_linear"
    if hasattr(qkv, "wqkv"):  # FusedQKVLinear: per key head [its query heads, key, value]
        parts = [
            fused_qkv(fqn, (f"{name}.wqkv.{what}", t), n_heads, n_kv, head_dim, "grouped")
            for what in ("weight", "bias")
            if (t := getattr(qkv.wqkv, what, None)) is not None
        ]
        return _merge(fqn, parts)
    if hasattr(qkv, "wq") and hasattr(qkv, "wk"):
        biases = [
            (f"{name}.{w}.bias", getattr(qkv, w).bias, part)
            for w, part in (("wq", "q"), ("wk", "k"))
            if getattr(getattr(qkv, w), "bias", None) is not None
        ]
        return separate_projections(
            fqn,
            (f"{name}.wq.weight", qkv.wq.weight),
            (f"{name}.wk.weight", qkv.wk.weight),
            n_heads,
            n_kv,
            head_dim,
            biases,
        )
    raise QKClipRefused(
        f"QK-Clip: {fqn}: its qkv_linear ({type(qkv).__name__}) is neither QKVLinear nor "
        f"FusedQKVLinear, so QK-Clip does not know its head rows: {WAY_OUT}"
    )


def _heads(fqn: str, module: nn.Module) -> AttentionHeads:
    cls = type(module).__name__
    if hasattr(module, "wkv_b") and hasattr(module, "qk_nope_head_dim"):  # deepseek_v3 MLA
        q_name = "wq" if getattr(module, "q_lora_rank", 0) == 0 else "wq_b"
        return mla(
            fqn,
            (f"{fqn}.{q_name}.weight", getattr(module, q_name).weight),
            (f"{fqn}.wkv_b.weight", module.wkv_b.weight),
            module.n_heads,
            module.qk_nope_head_dim,
            module.qk_rope_head_dim,
            module.v_head_dim,
        )
    if hasattr(module, "qkv_linear") and hasattr(module, "head_dim"):
        if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None):
            raise qk_norm_refused(fqn, cls)
        return _qkv_heads(fqn, module, module.n_heads, module.n_kv_heads, module.head_dim)
    raise unknown_attention_refused(fqn, cls)


describe_attention = inner_attention_describer(_heads, check_inner, visibility_hook)
"""The :class:`AttentionSite` of a torchtitan 0.3 attention module (any module with an
``inner_attention``); None for other modules."""
