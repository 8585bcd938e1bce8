"""QK-Clip in a training job: find the attention layers, hook the statistic, clip after each
step, report at each log step. Shared by every framework layer.

A framework layer supplies a *describer*: ``describe(fqn, module)`` returns an
:class:`AttentionSite` for each attention module it knows (its heads' rows, and how to hook
the q and k its attention call multiplies), ``None`` for every other module, and raises
:class:`QKClipRefused` (naming the module and the way out) for an attention module whose logits
or rows it cannot report. :func:`build_qk_clip` walks the model parts with it and returns the
:class:`~muon_plugin.qk_clip.QKClip`, or None when ``optimizer.muon.qk_clip_tau`` is unset;
:func:`attach_qk_clip` runs it after every optimizer step (through the framework's step
post-hook, registered before any the framework adds later, such as float8's scale
precomputation, so those see the clipped weights) and logs what it clips.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from muon_plugin.adapter.job import is_rank0
from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.param_groups.rules import WRAPPER_PREFIXES, strip_fqn
from muon_plugin.qk_clip import AttentionHeads, QKClip, QKClipReport

__all__ = [
    "AttentionSite",
    "Describer",
    "QKClipRefused",
    "Recorder",
    "attach_qk_clip",
    "build_qk_clip",
    "log_qk_clip",
]

logger = logging.getLogger(__name__)

Recorder = Callable[..., None]
"""``record(q, k, *, scale=None, visible=None)``: one attention call's q ``[B, Hq, Lq, D]``
and k ``[B, Hk, Lk, D]`` (see :meth:`muon_plugin.qk_clip.QKClip.record`)."""


class QKClipRefused(ValueError):
    """An attention module QK-Clip cannot serve; the message names it and the way out."""


@dataclass
class AttentionSite:
    """One attention module: its heads' rows and how to hook its statistic."""

    heads: AttentionHeads
    install: Callable[[Recorder], Any]
    """Hooks ``record`` into the module's attention call (returns a removable handle)."""


Describer = Callable[[str, nn.Module], AttentionSite | None]


def unwrapped_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` without the wrappers torch.compile, activation checkpointing
    and FSDP1 insert, each module named without their components: a wrapper forwards attribute
    access to the module it wraps (torchtitan compiles deepseek_v3's attention modules one by
    one), so it would be described a second time, under another name."""
    wrapper_children = {prefix.rstrip(".") for prefix in WRAPPER_PREFIXES}
    for name, module in model.named_modules():
        if wrapper_children & module._modules.keys():
            continue
        yield strip_fqn(name), module


def build_qk_clip(
    parts: Sequence[nn.Module],
    cfg: MuonConfig,
    describe: Describer,
    group: dist.ProcessGroup | None,
    option: str = "optimizer.muon.qk_clip_tau",
    pipeline: bool = False,
) -> QKClip | None:
    """The job's QK-Clip over every attention module ``describe`` finds in ``parts``; None
    when ``cfg.qk_clip_tau`` is unset. ``group``: the data- and context-parallel ranks.

    Raises :class:`QKClipRefused` for a module the describer refuses, or when no attention
    module is found (``option`` names the setting in the message), except with ``pipeline``
    (this rank's stages may hold no attention layer: then None, and one log line; the ranks
    of its data-parallel group hold the same stages, so none of them reduces either).
    """
    if cfg.qk_clip_tau is None:
        return None
    sites: list[AttentionSite] = []
    for part in parts:
        for name, module in unwrapped_modules(part):
            site = describe(name, module)
            if site is not None:
                sites.append(site)
    if not sites and pipeline:
        logger.info("QK-Clip: this rank's pipeline stages hold no attention layer")
        return None
    if not sites:
        raise QKClipRefused(
            f"{option} is set, but no attention module QK-Clip can serve was found in the "
            "model; unset it"
        )
    clip = QKClip(
        [s.heads for s in sites],
        tau=cfg.qk_clip_tau,
        alpha=cfg.qk_clip_alpha,
        gqa_rule=cfg.qk_clip_gqa,
        group=group,
    )
    for i, site in enumerate(sites):
        site.install(functools.partial(clip.record, i))
    return clip


def attach_qk_clip(
    clip: QKClip | None,
    register_step_post_hook: Callable[[Callable[..., None]], Any],
    log: logging.Logger | None = None,
) -> None:
    """Run ``clip.step()`` after every optimizer step; log (rank 0) what it clips."""
    if clip is None:
        return
    register_step_post_hook(lambda *args, **kwargs: clip.step())
    if is_rank0():
        (log or logger).info(clip.describe())


def log_qk_clip(clip: QKClip | None, log: logging.Logger | None = None) -> QKClipReport | None:
    """At a log step, on rank 0: read the last step's statistic (one host synchronization),
    log its line and any warning, return the report (for the framework's metrics). Rank 0
    reports the heads it holds (under tensor parallelism: its share; under pipeline
    parallelism: its stage's layers)."""
    if clip is None or clip.steps == 0 or not is_rank0():
        return None
    report = clip.report()
    log = log or logger
    log.info(report.format())
    for warning in report.warnings():
        log.warning(warning)
    return report
