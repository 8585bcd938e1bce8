"""The end-of-run summary on torchtitan 0.3: :mod:`muon_plugin.torchtitan.summary` on 0.3's
``MetricsProcessor``.

torchtitan 0.3's ``Trainer`` calls ``MetricsProcessor.log`` (same arguments as 0.2.2) at every
log step and ``close`` at the end, so the same wrappers record the run and log the summary on
rank 0. Only the checkpoint folder is found differently: 0.3's processor keeps no job config;
its ``__init__`` gets the ``dump_folder`` and the whole config as ``config_dict``, whose
``checkpoint`` entry has ``enable`` and ``folder``.

Installed by :func:`muon_plugin.torchtitan03.activate` (importing this module changes nothing).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

__all__ = ["checkpoint_folder", "install"]


def checkpoint_folder(processor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The run's checkpoint folder from ``MetricsProcessor.__init__``'s arguments; None when
    checkpointing is off (or the config was not passed)."""
    from torchtitan.components.metrics import MetricsProcessor

    bound = inspect.signature(MetricsProcessor.__init__).bind(processor, *args, **kwargs)
    bound.apply_defaults()
    config = bound.arguments.get("config_dict") or {}
    ckpt = config.get("checkpoint") if isinstance(config, dict) else None
    if not isinstance(ckpt, dict) or not ckpt.get("enable"):
        return None
    dump_folder = bound.arguments.get("dump_folder") or config.get("dump_folder") or "."
    return os.path.join(dump_folder, ckpt.get("folder", "checkpoint"))


def install() -> None:
    """Record every torchtitan 0.3 ``MetricsProcessor`` run for the summary (idempotent)."""
    from torchtitan.components.metrics import MetricsProcessor

    from muon_plugin.torchtitan.summary import install_on

    install_on(MetricsProcessor, checkpoint_folder=checkpoint_folder)
