"""QK-Clip on torchtitan 0.2.2: the attention modules of its models, described for
:mod:`muon_plugin.qk_clip`.

Every 0.2.2 language model keeps its attention call in an ``inner_attention`` submodule
(``ScaledDotProductAttentionWrapper``, ``FlexAttentionWrapper``, ``VarlenAttentionWrapper``)
that receives ``q`` and ``k`` as ``[B, heads, L, D]`` after rope (and qk-norm): a forward
pre-hook there records the max logit per head with the call's own scale and mask (causal for
SDPA, the ``BlockMask``'s ``mask_mod`` for Flex, the packed documents of varlen). Rows:

- llama3, llama4, qwen3 (``Attention``: ``wq`` / ``wk``, GQA by ``n_kv_heads``) and gpt_oss
  (the same with biases; its sinks are not q.k logits and are left out);
- deepseek_v3 (MLA): ``wq`` or ``wq_b`` (no-rope and rope rows per head) and ``wkv_b`` (key
  rows per head); the shared rope key in ``wkv_a`` is never touched.

Refused at build time, with the module's name and the way out: an attention module with
per-head q/k norms (qwen3's ``qk_norm``: the norm undoes a row scaling), an ``inner_attention``
of another type, any other module with an ``inner_attention``, and context parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from muon_plugin.adapter.qk_clip import AttentionSite, Describer, QKClipRefused, Recorder
from muon_plugin.qk_clip import AttentionHeads, Visibility, mla, separate_projections

__all__ = [
    "INNER_ATTENTIONS",
    "check_inner",
    "inner_attention_check",
    "describe_attention",
    "WAY_OUT",
    "documents_of",
    "inner_attention_describer",
    "qk_clip_group",
    "qk_norm_refused",
    "unknown_attention_refused",
    "visibility_hook",
]

OPTION = "optimizer.muon.qk_clip_tau"
WAY_OUT = f"unset {OPTION} (QK-Clip off)"


def documents_of(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Per token ``[B, L]`` document ids from packed ``cu_seqlens`` over ``B * L`` tokens."""
    tokens = torch.arange(batch * seq_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(tokens.dtype), tokens, right=True).view(
        batch, seq_len
    )


def _block_mask_visibility(fqn: str, block_mask: Any) -> Visibility:
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise QKClipRefused(
            f"QK-Clip: {fqn}: FlexAttention was called with a {type(block_mask).__name__} as "
            f"its block mask, not a BlockMask; QK-Clip cannot tell which logits it computes: "
            f"{WAY_OUT}, or use attn_type = 'sdpa'"
        )
    batch, heads = block_mask.kv_num_blocks.shape[:2]
    return Visibility(
        mask_mod=block_mask.mask_mod, mask_shape=(batch, heads), block_mask=block_mask
    )


INNER_ATTENTIONS = (
    "ScaledDotProductAttentionWrapper",
    "FlexAttentionWrapper",
    "VarlenAttentionWrapper",
)
"""The ``inner_attention`` types whose calls QK-Clip reads."""


def inner_attention_check(
    known: tuple[str, ...], described: str
) -> Callable[[str, nn.Module], None]:
    """The check that refuses an ``inner_attention`` whose type is not in ``known`` (the
    release's attention types QK-Clip can read; ``described``: how the message names them)."""

    def check_inner(fqn: str, inner: nn.Module) -> None:
        """Refuse an ``inner_attention`` whose call QK-Clip cannot read."""
        if type(inner).__name__ not in known:
            raise QKClipRefused(
                f"QK-Clip: {fqn}.inner_attention is a {type(inner).__name__}, whose logits "
                f"QK-Clip cannot record (it knows torchtitan's {described}): {WAY_OUT}"
            )

    return check_inner


check_inner = inner_attention_check(INNER_ATTENTIONS, "SDPA, FlexAttention and varlen wrappers")


def visibility_hook(fqn: str, inner: nn.Module, record: Recorder) -> Any:
    """Hook ``record`` into a torchtitan 0.2.2 ``inner_attention`` module (its q, k, scale and
    mask); returns the hook handle."""
    check_inner(fqn, inner)
    kind = type(inner).__name__

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        q, k = args[0], args[1]
        scale = kwargs.get("scale")
        if kind == "ScaledDotProductAttentionWrapper":
            visible = Visibility(causal=kwargs.get("is_causal", True))
        elif kind == "FlexAttentionWrapper":
            if kwargs.get("score_mod") is not None:
                raise QKClipRefused(
                    f"QK-Clip: {fqn}: FlexAttention with a score_mod changes the logits; "
                    f"QK-Clip records q.k only: {WAY_OUT}"
                )
            visible = _block_mask_visibility(fqn, kwargs.get("block_mask"))
        else:  # VarlenAttentionWrapper(xq, xk, xv, attention_masks, scale=...)
            meta = args[3] if len(args) > 3 else kwargs["attention_masks"]
            b, _, seq, _ = q.shape
            visible = Visibility(causal=True, documents=documents_of(meta.cu_seq_q, b, seq))
        record(q, k, scale=scale, visible=visible)

    return inner.register_forward_pre_hook(hook, with_kwargs=True)


def qk_norm_refused(fqn: str, cls: str) -> QKClipRefused:
    """The refusal of an attention module with per-head q / k norms (qwen3's ``qk_norm``)."""
    return QKClipRefused(
        f"QK-Clip: {fqn} ({cls}) normalizes q and k per head (qk_norm): the norm undoes any "
        "scaling of the q / k rows, and its gains are shared by all heads, so QK-Clip cannot "
        f"bound one head; qk_norm already bounds the logits: {WAY_OUT}"
    )


def unknown_attention_refused(fqn: str, cls: str) -> QKClipRefused:
    """The refusal of a module with an ``inner_attention`` whose head rows are unknown."""
    return QKClipRefused(
        f"QK-Clip: {fqn} ({cls}) has an inner attention, but QK-Clip does not know which rows "
        f"of its parameters are each head's query and key: {WAY_OUT}"
    )


def inner_attention_describer(
    heads_of: Callable[[str, nn.Module], AttentionHeads],
    check: Callable[[str, nn.Module], None],
    hook: Callable[[str, nn.Module, Recorder], Any],
) -> Describer:
    """A :data:`~muon_plugin.adapter.qk_clip.Describer` for torchtitan's models: every module
    with an ``inner_attention`` is an attention site, its rows from ``heads_of``, its inner
    attention checked by ``check`` and hooked by ``hook``."""

    def describe(fqn: str, module: nn.Module) -> AttentionSite | None:
        inner = getattr(module, "inner_attention", None)
        if not isinstance(inner, nn.Module):
            return None
        heads = heads_of(fqn, module)
        check(fqn, inner)
        return AttentionSite(heads, lambda record: hook(fqn, inner, record))

    return describe


def _weight(fqn: str, linear: nn.Module, what: str = "weight") -> tuple[str, torch.Tensor]:
    return f"{fqn}.{what}", getattr(linear, what)


def _heads(fqn: str, module: nn.Module) -> AttentionHeads:
    cls = type(module).__name__
    if hasattr(module, "wkv_b") and hasattr(module, "qk_nope_head_dim"):  # deepseek_v3 MLA
        q_name = "wq" if getattr(module, "q_lora_rank", 0) == 0 else "wq_b"
        return mla(
            fqn,
            _weight(f"{fqn}.{q_name}", getattr(module, q_name)),
            _weight(f"{fqn}.wkv_b", module.wkv_b),
            module.n_heads,
            module.qk_nope_head_dim,
            module.qk_rope_head_dim,
            module.v_head_dim,
        )
    if all(hasattr(module, a) for a in ("wq", "wk", "n_heads", "n_kv_heads", "head_dim")):
        if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None):
            raise qk_norm_refused(fqn, cls)
        biases = [
            (f"{fqn}.{name}.bias", getattr(module, name).bias, part)
            for name, part in (("wq", "q"), ("wk", "k"))
            if getattr(module, name).bias is not None
        ]
        return separate_projections(
            fqn,
            _weight(f"{fqn}.wq", module.wq),
            _weight(f"{fqn}.wk", module.wk),
            module.n_heads,
            module.n_kv_heads,
            module.head_dim,
            biases,
        )
    raise unknown_attention_refused(fqn, cls)


describe_attention = inner_attention_describer(_heads, check_inner, visibility_hook)
"""The :class:`AttentionSite` of a torchtitan 0.2.2 attention module (any module with an
``inner_attention``); None for other modules."""


def qk_clip_group(parallel_dims: Any) -> Any:
    """The process group of the data- and context-parallel ranks (torchtitan's ``loss``
    mesh), None when there is one; refuses context parallelism."""
    if parallel_dims is None:
        return None
    if getattr(parallel_dims, "cp", 1) > 1:
        raise QKClipRefused(
            f"QK-Clip: context parallelism (parallelism.context_parallel_degree = "
            f"{parallel_dims.cp}) splits each sequence's keys over ranks, so no rank sees a "
            f"head's logits; {WAY_OUT} or set parallelism.context_parallel_degree = 1"
        )
    if not dist.is_initialized():  # one process: nothing to reduce over
        return None
    mesh = parallel_dims.get_optional_mesh("loss")
    return None if mesh is None else mesh.get_group()
