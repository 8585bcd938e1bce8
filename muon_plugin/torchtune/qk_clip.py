"""QK-Clip in torchtune 0.6.1: its ``MultiHeadAttention``, described for
:mod:`muon_plugin.qk_clip`.

``MultiHeadAttention`` projects with ``q_proj`` / ``k_proj`` (head-major rows; biases too when
it has them) and calls ``self._attention_call(q, k, v, mask, dropout_p, is_causal)`` with
``q`` and ``k`` as ``[B, heads, L, D]`` after rope, the keys already repeated for grouped-query
attention; the mask is None (causal when ``is_causal``), a boolean ``[B, Lq, Lk]`` tensor (True
attends) or a FlexAttention ``BlockMask`` (packed samples). QK-Clip wraps that call on each
module (its computation unchanged) and records the max logit per head with the call's mask.
Under tensor parallelism torchtune keeps the *local* head counts on the module
(``prepare_mha_for_tp``): the global ones come from the projection weights' global shapes.

Refused at build time, with the module's name and the way out: per-head q/k norms
(``q_norm`` / ``k_norm``) and any other module with an ``_attention_call``. The data-parallel
group is the ``"dp"`` mesh dim of the recipe's device mesh, read off the parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from muon_plugin.adapter.qk_clip import AttentionSite, QKClipRefused, Recorder
from muon_plugin.qk_clip import AttentionHeads, Visibility, separate_projections
from muon_plugin.torchtune.options import SECTION

__all__ = ["data_parallel_group", "describe_attention", "wrap_attention_call"]

WAY_OUT = f"remove {SECTION}.qk_clip_tau (QK-Clip off)"
DATA_PARALLEL_DIMS = ("dp",)


def _visibility(mask: Any, is_causal: bool) -> Visibility:
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(mask, BlockMask):
        batch, heads = mask.kv_num_blocks.shape[:2]
        return Visibility(mask_mod=mask.mask_mod, mask_shape=(batch, heads), block_mask=mask)
    if isinstance(mask, torch.Tensor):
        return Visibility(dense=mask)
    return Visibility(causal=bool(is_causal))


class _RecordingCall:
    """``MultiHeadAttention._attention_call`` that records the logits first."""

    def __init__(self, original: Any, record: Recorder) -> None:
        self.original = original
        self.record = record

    def __call__(self, q, k, v, mask=None, dropout_p=0.0, is_causal=True):
        self.record(q, k, visible=_visibility(mask, is_causal))
        return self.original(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)


class _Handle:
    def __init__(self, module: nn.Module, call: _RecordingCall) -> None:
        self.module, self.call = module, call

    def remove(self) -> None:
        if self.module._attention_call is self.call:
            self.module._attention_call = self.call.original


def wrap_attention_call(module: nn.Module, record: Recorder) -> _Handle:
    """Make ``module._attention_call`` record its q and k first; returns a removable handle."""
    call = _RecordingCall(module._attention_call, record)
    module._attention_call = call
    return _Handle(module, call)


def describe_attention(fqn: str, module: nn.Module) -> AttentionSite | None:
    """The :class:`AttentionSite` of a torchtune ``MultiHeadAttention`` (any module with an
    ``_attention_call``); None for other modules."""
    if not callable(getattr(module, "_attention_call", None)):
        return None
    cls = type(module).__name__
    if not all(hasattr(module, a) for a in ("q_proj", "k_proj", "head_dim")):
        raise QKClipRefused(
            f"QK-Clip: {fqn} ({cls}) has an attention call, but QK-Clip does not know which "
            f"rows of its parameters are each head's query and key: {WAY_OUT}"
        )
    if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None:
        raise QKClipRefused(
            f"QK-Clip: {fqn} ({cls}) normalizes q and k per head (q_norm / k_norm): the norm "
            "undoes any scaling of the projection rows, so QK-Clip cannot bound one head; the "
            f"norm already bounds the logits: {WAY_OUT}"
        )
    wq, wk = module.q_proj.weight, module.k_proj.weight
    hd = module.head_dim
    biases = [
        (f"{fqn}.{name}.bias", getattr(module, name).bias, part)
        for name, part in (("q_proj", "q"), ("k_proj", "k"))
        if getattr(getattr(module, name), "bias", None) is not None
    ]
    heads: AttentionHeads = separate_projections(
        fqn,
        (f"{fqn}.q_proj.weight", wq),
        (f"{fqn}.k_proj.weight", wk),
        wq.shape[0] // hd,  # global counts: TP leaves the local ones on the module
        wk.shape[0] // hd,
        hd,
        biases,
    )
    return AttentionSite(heads, lambda record: wrap_attention_call(module, record))


def data_parallel_group(model: nn.Module) -> Any:
    """The process group of the recipe's ``"dp"`` mesh dim (the parameters' mesh), None
    without data parallelism."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for name in DATA_PARALLEL_DIMS:
                if name in names and p.device_mesh.size(names.index(name)) > 1:
                    return p.device_mesh.get_group(name)
            return None
    return None
