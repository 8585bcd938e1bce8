"""What torchtune 0.6.1's distributed full-finetune recipe needs to run on CPUs (gloo).

The recipe trains on CPU devices with gloo as it is, except for three accelerator-only calls:
with ``enable_async_checkpointing`` (or ``fsdp_cpu_offload``) it asks for the backend
``"cpu:gloo,cpu:gloo"``, which ``init_process_group`` refuses (``gloo`` is the CPU backend
already); rank 0 logs accelerator memory statistics after the model set-up
(``training.get_memory_stats`` raises on a CPU device); ``training.cleanup_before_training``
empties the accelerator cache (``torch.cpu`` has no ``empty_cache``). :func:`on_cpu` replaces
the three by what they mean on a CPU (gloo; no statistics; a garbage collection) inside the
block. And its asynchronous DCP save runs collectives in a background thread on the default
process group: on accelerators that group's CPU part is a gloo group training does not use,
on CPUs it is the training group, and the two threads' collectives deadlock;
:func:`own_checkpoint_group` gives the DCP checkpointer a gloo group of its own. Nothing changes
on accelerators.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torchtune import training

__all__ = ["on_cpu", "own_checkpoint_group"]


def _no_stats(*args: Any, **kwargs: Any) -> dict[str, float]:
    return {}


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _collect() -> None:
    gc.collect()


def _gloo(*args: Any, **kwargs: Any) -> str:
    return "gloo"


_CPU_VERSIONS = {
    "get_distributed_backend": _gloo,
    "get_memory_stats": _no_stats,
    "log_memory_stats": _no_log,
    "cleanup_before_training": _collect,
}


@contextmanager
def on_cpu(device: torch.device | str) -> Iterator[None]:
    """On a CPU ``device``, torchtune's accelerator-only functions are CPU no-ops in the block."""
    if torch.device(device).type != "cpu":
        yield
        return
    saved = {name: getattr(training, name) for name in _CPU_VERSIONS}
    for name, replacement in _CPU_VERSIONS.items():
        setattr(training, name, replacement)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(training, name, original)


def own_checkpoint_group(checkpoint_client: Any, device: torch.device | str) -> None:
    """On a CPU ``device`` with several processes, make ``checkpoint_client`` (the recipe's
    ``CheckpointClient``) build its DCP checkpointer on a new gloo group."""
    if torch.device(device).type != "cpu" or not dist.is_initialized():
        return
    if dist.get_world_size() < 2:
        return
    group = dist.new_group(backend="gloo")  # collective: every rank creates it
    build = checkpoint_client._get_dcp_checkpointer

    def with_own_group() -> Any:
        checkpointer = build()
        checkpointer._process_group = group
        return checkpointer

    checkpoint_client._get_dcp_checkpointer = with_own_group
