"""The end-of-run summary and the skipped-update count, through torchtitan's metrics processor.

torchtitan's ``Trainer`` (0.2.2 and 0.3 alike) calls ``metrics_processor.log(step, loss, ...)``
at every log step (``metrics.log_freq``) and ``metrics_processor.close()`` once at the end (also
after an error). :func:`install` wraps those two methods of 0.2.2's ``MetricsProcessor`` (and its
``__init__``, which starts the clock), whatever train spec built it: ``log`` records the loss,
the global token count and the peak device memory (torchtitan resets the peak at each log),
warns (rank 0) when Muon skipped non-finite updates, and, with QK-Clip on, logs its line and
adds its metrics (``qk_clip/max_logit``, ``qk_clip/heads_clipped``, per layer
``qk_clip/max_logit_layer_<i>``) to the step's ``extra_metrics``; ``close`` logs (rank 0)
the summary of the adapter core (:class:`muon_plugin.adapter.summary.RunSummary`).

Nothing here changes what torchtitan logs or computes. The module imports on both releases;
torchtitan 0.3's plugin installs it with :func:`install_on` and its own checkpoint-folder rule
(:mod:`muon_plugin.torchtitan03.summary`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from torchtitan.tools.logging import logger

from muon_plugin.adapter.job import is_rank0
from muon_plugin.adapter.qk_clip import log_qk_clip
from muon_plugin.adapter.summary import RunSummary

__all__ = [
    "CheckpointFolder",
    "RunSummary",
    "install",
    "install_on",
    "job_checkpoint_folder",
    "skipped_updates",
]

_MARK = "_muon_plugin_hook"


def skipped_updates(optimizers: Any) -> int:
    """Muon matrix updates skipped (non-finite direction) so far, on this rank."""
    if optimizers is None:
        return 0
    return sum(int(getattr(opt, "skipped_updates", 0)) for opt in optimizers)


def job_checkpoint_folder(job_config: Any) -> str | None:
    """A torchtitan 0.2.2 job's checkpoint folder; None when checkpointing is off."""
    ckpt = getattr(job_config, "checkpoint", None)
    if ckpt is None or not ckpt.enable:
        return None
    return os.path.join(job_config.job.dump_folder, ckpt.folder)


CheckpointFolder = Callable[[Any, tuple[Any, ...], dict[str, Any]], str | None]
"""``(processor, init args, init kwargs) -> checkpoint folder or None`` (checkpointing off)."""


def _processor_checkpoint_folder(processor: Any, args: Any = (), kwargs: Any = None) -> str | None:
    return job_checkpoint_folder(getattr(processor, "job_config", None))


def _summary(processor: Any) -> RunSummary:
    summary = processor.__dict__.get("_muon_summary")
    if summary is None:  # a processor built before install_on: a 0.2.2 job_config, if any
        summary = RunSummary(_processor_checkpoint_folder(processor))
        processor._muon_summary = summary
    return summary


def _with_qk_clip_metrics(processor: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``log``'s arguments with QK-Clip's metrics added to ``extra_metrics`` (and its line
    logged, rank 0) when the run's Muon optimizers clip."""
    job = getattr(getattr(processor, "optimizers", None), "job", None)
    report = log_qk_clip(getattr(job, "qk_clip", None), logger)
    if report is None:
        return args, kwargs
    if len(args) > 2:  # extra_metrics passed by position
        args = (*args[:2], {**(args[2] or {}), **report.metrics()}, *args[3:])
    else:
        kwargs = {
            **kwargs,
            "extra_metrics": {**(kwargs.get("extra_metrics") or {}), **report.metrics()},
        }
    return args, kwargs


def _record(processor: Any, original_log: Any, step: int, loss: float, *args: Any, **kwargs: Any):
    try:
        memory = processor.device_memory_monitor.get_peak_stats().max_reserved_gib
    except Exception:  # a summary must never stop training
        memory = 0.0
    summary = _summary(processor)  # created before the first log: its clock starts earlier
    args, kwargs = _with_qk_clip_metrics(processor, args, kwargs)
    original_log(processor, step, loss, *args, **kwargs)
    extra = kwargs.get("extra_metrics", args[2] if len(args) > 2 else None) or {}
    tokens = extra.get("n_tokens_seen")
    summary.record(step, loss, None if tokens is None else int(tokens), memory, time.perf_counter())
    skipped = skipped_updates(getattr(processor, "optimizers", None))
    summary.skipped = skipped
    if skipped and is_rank0():
        logger.warning(
            f"Muon: {skipped} matrix updates skipped so far on rank 0 (non-finite "
            "direction, optimizer.muon.skip_nonfinite = true)"
        )


def install_on(cls: Any, checkpoint_folder: CheckpointFolder | None = None) -> None:
    """Wrap ``cls.__init__`` / ``log`` / ``close`` (a metrics-processor class) once.

    ``checkpoint_folder`` finds the run's checkpoint folder from the processor and its
    ``__init__`` arguments; by default from a 0.2.2 processor's ``job_config``.
    """
    if getattr(cls.log, _MARK, False):
        return
    original_init, original_log, original_close = cls.__init__, cls.log, cls.close
    find_folder = checkpoint_folder or _processor_checkpoint_folder

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            folder = find_folder(self, args, kwargs)
        except Exception:  # a summary must never stop training
            folder = None
        self._muon_summary = RunSummary(folder)  # its clock starts here

    @functools.wraps(original_log)
    def log(self: Any, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
        _record(self, original_log, step, global_avg_loss, *args, **kwargs)

    @functools.wraps(original_close)
    def close(self: Any) -> None:
        try:
            if is_rank0():
                logger.info(_summary(self).format())
        finally:
            original_close(self)

    for fn in (__init__, log, close):
        setattr(fn, _MARK, True)
    cls.__init__, cls.log, cls.close = __init__, log, close


def install() -> None:
    """Record every torchtitan ``MetricsProcessor`` run for the summary (idempotent)."""
    from torchtitan.components.metrics import MetricsProcessor

    install_on(MetricsProcessor)
