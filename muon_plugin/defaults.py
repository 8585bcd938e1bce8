"""Every choice and default of the optimizer, in one place (no imports: the lowest layer).

The optimizer's constructor, its param-group validation, the orthogonalization, MuonLP and the
torchtitan / torchtune option schemas all read the names and defaults below; none writes its
own copy.
"""

from __future__ import annotations

from typing import Any

ALGORITHMS: tuple[str, ...] = ("muon", "adamw", "adam")
"""Per param group: ``"muon"``, ``"adamw"`` (decoupled decay) or ``"adam"`` (L2 decay)."""

STRATEGIES: tuple[str, ...] = ("polar_express", "newton_schulz", "turbo_muon")
"""Orthogonalization iterations (coefficient schedules). ``"turbo_muon"``: AOL row scaling of
the input instead of the Frobenius norm, with its fitted schedule; meant for ``ns_steps=4``,
and it approximates the polar factor of the row-scaled matrix (see
``muon_plugin.orthogonalize.coefficients`` and docs/design/turbo_aol.md)."""

LR_ADJUSTMENTS: tuple[str, ...] = ("keller", "match_rms_adamw", "spectral", "none")
"""Muon's learning-rate shape rules."""

BACKENDS: tuple[str, ...] = ("auto", "eager", "cublas", "plain")
"""Built-in orthogonalization backends: ``"auto"`` picks the fastest exact-enough path per
shape group (Triton symmetric kernels, Gram-space iteration, fp16 Q-form, CUDA graphs where
they pay), ``"eager"`` the same without CUDA graphs (nothing kept between steps: less memory on
models of many small matrices, at some speed there), ``"cublas"`` the same as ``"auto"``
without Triton kernels, ``"plain"`` the plain bf16 loop on torch matmuls (the reference)."""

STATE_DTYPES: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "fp8")
"""Momentum storage: ``"fp32"`` (Muon / MuonForeach), the others select MuonLP."""

LP_STATE_DTYPES: tuple[str, ...] = STATE_DTYPES[1:]
"""The low-precision momentum formats of MuonLP."""

NORMALIZATIONS: tuple[str, ...] = ("none", "normuon")
"""What happens to a Muon group's orthogonalized update before it is applied: ``"none"``
(Muon) or ``"normuon"`` (NorMuon, arXiv:2510.05491: each row divided by the root of its running
mean square, then the whole matrix rescaled)."""

NORMUON_RESCALES: tuple[str, ...] = ("frobenius", "rms")
"""NorMuon's rescale of a normalized matrix (each row block of a fused weight on its own):
``"frobenius"`` keeps the Frobenius norm of Muon's update (the NorMuon authors' code), ``"rms"``
gives the norm an exactly orthogonal update would have under ``lr_adjust`` (the paper's rule:
with ``"match_rms_adamw"``, an update RMS of 0.2)."""

IMPLEMENTATIONS: tuple[str, ...] = ("foreach", "per_param")
"""``"foreach"``: MuonForeach (batched); ``"per_param"``: Muon (matrix by matrix)."""

NS_EPS = 1e-7
"""Lower bound on the norm the orthogonalization input is divided by."""

MAX_NS_STEPS = 100
"""``ns_steps`` must be below this."""

DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "wd": 0.1,
    "use_cautious_wd": True,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "orthogonalization_strategy": "polar_express",
    "adam_betas": (0.9, 0.95),
    "adam_eps": 1e-8,
    "is_adamw": True,
    "fused_adam": True,
    "compile": False,
    "lr_adjust": "keller",
    "flatten": False,
    "split_sizes": None,
    "ns_coefficients": None,
    "ns_eps": NS_EPS,
    "backend": "auto",
    "normalization": "none",
    "normuon_beta2": 0.95,
    "normuon_eps": 1e-8,
    "normuon_rescale": "frobenius",
    "algorithm": "muon",
}
"""The optimizer's constructor defaults, which every param-group key falls back to."""

PLUGIN_LR_ADJUST = "match_rms_adamw"
"""The framework plugins' ``lr_adjust``: a job's AdamW lr and weight decay keep working."""

SKIP_NONFINITE = False
"""Constructor-only: skip the update of a Muon matrix whose direction is non-finite."""

PLUGIN_IMPLEMENTATION = "foreach"
"""The framework plugins' optimizer class: MuonForeach (see :data:`IMPLEMENTATIONS`)."""

PLUGIN_STATE_DTYPE = "fp32"
"""The framework plugins' momentum storage: fp32, no MuonLP (see :data:`STATE_DTYPES`)."""

QK_CLIP_ALPHA = 0.5
"""QK-Clip: a clipped head's query rows scale by ``gamma^alpha``, its key rows by
``gamma^(1 - alpha)`` (Kimi K2, Megatron)."""

QK_CLIP_GQA_RULES: tuple[str, ...] = ("query", "group")
"""QK-Clip with grouped-query attention: ``"query"`` scales each query head by its own
``gamma`` and leaves the shared key rows alone; ``"group"`` (Megatron) clips each key group by
its largest logit, all its query heads by ``eta^alpha`` and its key by ``eta^(1 - alpha)``."""

QK_CLIP_GQA_RULE = "query"
"""The default GQA rule (see :data:`QK_CLIP_GQA_RULES`)."""

QK_CLIP_CHUNK_BYTES = 256 * 2**20
"""Working memory of one attention call's max-logit computation (logits and mask of a chunk
of queries)."""
