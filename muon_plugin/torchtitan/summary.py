"""The end-of-run summary and the skipped-update count, through torchtitan's metrics processor.

torchtitan's ``Trainer`` (0.2.2 and 0.3 alike) calls ``metrics_processor.log(step, loss, ...)``
at every log step (``metrics.log_freq``) and ``metrics_processor.close()`` once at the end (also
after an error). :func:`install` wraps those two methods of 0.2.2's ``MetricsProcessor`` (and its
``__init__``, which starts the clock), whatever train spec built it: ``log`` records the loss,
the global token count and the peak device memory (torchtitan resets the peak at each log), and
warns (rank 0) when Muon skipped non-finite updates; ``close`` logs (rank 0) the summary::

    Run summary: 30 steps (1-30) in 41.2 s
      loss: final 5.1234, mean of the last 10 steps 5.2345
      throughput: 12,345 tokens/s over all ranks (steps 2-30)
      peak memory (rank 0): 1.23 GiB
      checkpoints: outputs/x/checkpoint (step-10, step-20, step-30)

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

import torch.distributed as dist
from torchtitan.tools.logging import logger

__all__ = [
    "CheckpointFolder",
    "RunSummary",
    "install",
    "install_on",
    "job_checkpoint_folder",
    "skipped_updates",
]

_MARK = "_muon_plugin_hook"

LAST_STEPS = 10
"""The summary's mean loss is over this many last logged steps."""


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


class RunSummary:
    """What one run logged: loss per step, global tokens, peak memory; formats the summary."""

    def __init__(self, checkpoint_folder: str | None = None) -> None:
        """``checkpoint_folder``: where the run saves checkpoints; None when it does not."""
        self.checkpoint_folder = checkpoint_folder
        self.start = time.perf_counter()
        self.losses: list[tuple[int, float]] = []
        self.first_log: tuple[float, int] | None = None  # (time, global tokens) at the first log
        self.last_log: tuple[float, int] | None = None
        self.peak_memory_gib = 0.0
        self.skipped = 0

    def record(
        self, step: int, loss: float, tokens: int | None, memory_gib: float, now: float
    ) -> None:
        self.losses.append((step, float(loss)))
        self.peak_memory_gib = max(self.peak_memory_gib, float(memory_gib))
        if tokens is not None:
            if self.first_log is None:
                self.first_log = (now, int(tokens))
            self.last_log = (now, int(tokens))

    def checkpoints(self) -> str:
        """The checkpoint folder and the ``step-N`` checkpoints in it, as the summary shows them."""
        folder = self.checkpoint_folder
        if folder is None:
            return "none (checkpoint.enable = false)"
        steps = (
            sorted(
                (d for d in os.listdir(folder) if d.startswith("step-")),
                key=lambda d: int(d.split("-", 1)[1]) if d.split("-", 1)[1].isdigit() else -1,
            )
            if os.path.isdir(folder)
            else []
        )
        return f"{folder} ({', '.join(steps) if steps else 'none saved'})"

    def format(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        if not self.losses:
            return f"Run summary: no step logged, {now - self.start:.1f} s"
        first, last = self.losses[0][0], self.losses[-1][0]
        tail = self.losses[-LAST_STEPS:]
        mean = sum(v for _, v in tail) / len(tail)
        lines = [
            f"Run summary: {len(self.losses)} logged steps ({first}-{last}) in "
            f"{now - self.start:.1f} s",
            f"  loss: final {self.losses[-1][1]:.4f}, mean of the last {len(tail)} logged "
            f"steps {mean:.4f}",
        ]
        if self.first_log and self.last_log and self.last_log[0] > self.first_log[0]:
            rate = (self.last_log[1] - self.first_log[1]) / (self.last_log[0] - self.first_log[0])
            lines.append(
                f"  throughput: {rate:,.0f} tokens/s over all ranks (after step {first} to "
                f"step {last})"
            )
        lines.append(f"  peak memory (rank 0): {self.peak_memory_gib:.2f} GiB")
        if self.skipped:
            lines.append(f"  Muon updates skipped (non-finite, rank 0): {self.skipped}")
        lines.append(f"  checkpoints: {self.checkpoints()}")
        log_file = os.environ.get("MUON_RUN_LOG")
        if log_file:
            lines.append(f"  log: {log_file}")
        return "\n".join(lines)


def _summary(processor: Any) -> RunSummary:
    summary = processor.__dict__.get("_muon_summary")
    if summary is None:  # a processor built before install_on: a 0.2.2 job_config, if any
        summary = RunSummary(_processor_checkpoint_folder(processor))
        processor._muon_summary = summary
    return summary


def _record(processor: Any, original_log: Any, step: int, loss: float, *args: Any, **kwargs: Any):
    try:
        memory = processor.device_memory_monitor.get_peak_stats().max_reserved_gib
    except Exception:  # a summary must never stop training
        memory = 0.0
    summary = _summary(processor)  # created before the first log: its clock starts earlier
    original_log(processor, step, loss, *args, **kwargs)
    extra = kwargs.get("extra_metrics", args[2] if len(args) > 2 else None) or {}
    tokens = extra.get("n_tokens_seen")
    summary.record(step, loss, None if tokens is None else int(tokens), memory, time.perf_counter())
    skipped = skipped_updates(getattr(processor, "optimizers", None))
    summary.skipped = skipped
    if skipped and _is_rank0():
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
            if _is_rank0():
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
