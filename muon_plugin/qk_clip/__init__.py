"""QK-Clip (MuonClip, Kimi K2): keep every attention head's largest pre-softmax logit at or
below ``tau`` by rescaling its query and key rows after each optimizer step.

Framework-free: a framework layer describes its attention modules (:mod:`.heads`: which rows
of which parameters are head ``h``'s query / key / rope query), calls :meth:`QKClip.record`
with the q and k each attention call multiplies (:mod:`.logits` computes the max logit per
head), and runs :meth:`QKClip.step` after the optimizer step (:mod:`.rule`: the factors;
:mod:`.rescale`: the in-place multiply on local shards). The design and its cost:
``docs/design/qk_clip.md``.
"""

from muon_plugin.qk_clip.clip import HEAD_PARALLEL_DIMS, QKClip, QKClipReport, head_range
from muon_plugin.qk_clip.heads import (
    AttentionHeads,
    LayoutDescriptionError,
    RowBlock,
    fused_qkv,
    mla,
    separate_projections,
)
from muon_plugin.qk_clip.logits import max_logit_per_head, should_record
from muon_plugin.qk_clip.rule import ClipRule, LocalLayer
from muon_plugin.qk_clip.visibility import Visibility

__all__ = [
    "HEAD_PARALLEL_DIMS",
    "AttentionHeads",
    "ClipRule",
    "LayoutDescriptionError",
    "LocalLayer",
    "QKClip",
    "QKClipReport",
    "RowBlock",
    "Visibility",
    "fused_qkv",
    "head_range",
    "max_logit_per_head",
    "mla",
    "separate_projections",
    "should_record",
]
