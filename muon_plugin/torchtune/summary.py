"""The end-of-run summary of a torchtune run, from what the recipe logs.

torchtune's recipe logs, on rank 0 every ``log_every_n_steps``, ``metric_logger.log_dict`` with
``loss``, ``tokens_per_second_per_gpu`` and, with ``log_peak_memory_stats``, the peak memory in
GiB. :func:`record_run` wraps that method of the recipe's metric logger to feed the adapter
core's :class:`~muon_plugin.adapter.summary.RunSummary`; the recipe logs
:meth:`~muon_plugin.adapter.summary.RunSummary.format` when training ends. Nothing that torchtune
logs or computes changes.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from torchtune import utils

from muon_plugin.adapter.qk_clip import log_qk_clip
from muon_plugin.adapter.summary import RunSummary

__all__ = ["CHECKPOINT_PREFIXES", "record_run"]

log = utils.get_logger()

CHECKPOINT_PREFIXES = ("epoch_", "dist_epoch_")
"""How torchtune names its checkpoint folders: full state dicts, and DCP (async)."""


def record_run(
    metric_logger: Any,
    world_size: int,
    output_dir: str | None,
    skipped: Any = None,
    qk_clip: Any = None,
) -> RunSummary:
    """A summary that records every ``metric_logger.log_dict`` call from now on.

    ``skipped``: a callable returning Muon's skipped updates so far on this rank;
    ``qk_clip``: the run's :class:`~muon_plugin.qk_clip.QKClip` (None when off), whose line is
    logged and whose metrics join every logged step's payload.
    """
    summary = RunSummary(output_dir, CHECKPOINT_PREFIXES)
    original = metric_logger.log_dict

    @functools.wraps(original)
    def log_dict(payload: dict[str, Any], step: int, *args: Any, **kwargs: Any) -> Any:
        if qk_clip is not None and "loss" in payload:
            report = log_qk_clip(qk_clip, log)
            if report is not None:
                payload = {**payload, **report.metrics()}
        result = original(payload, step, *args, **kwargs)
        try:  # a summary must never stop training
            if "loss" in payload:
                rate = payload.get("tokens_per_second_per_gpu")
                summary.record(
                    int(step),
                    float(payload["loss"]),
                    None,
                    float(payload.get("peak_memory_reserved", 0.0)),
                    time.perf_counter(),
                    None if rate is None else float(rate) * world_size,
                )
            if skipped is not None:
                summary.skipped = int(skipped())
        except Exception:
            pass
        return result

    metric_logger.log_dict = log_dict
    return summary
