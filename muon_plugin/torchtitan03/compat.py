"""torch-version shims for torchtitan 0.3, which is released against torch 2.14.

:func:`apply` (called by :func:`muon_plugin.torchtitan03.activate`): torchtitan 0.3 lowers the
process-group timeouts after the first step with ``torch.distributed.set_timeout``, a function
torch added in 2.14; on older torch that call fails after step 1. There the timeout change is
skipped with a warning (the init timeout stays in force). Nothing changes on torch >= 2.14.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["apply"]


def apply() -> None:
    """Install the shims this torch needs (idempotent)."""
    if hasattr(dist, "set_timeout"):
        return
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.logging import logger

    original = dist_utils.set_pg_timeouts
    if getattr(original, "_muon_plugin_compat", False):
        return

    @functools.wraps(original)
    def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
        logger.warning(
            f"torch {torch.__version__} has no torch.distributed.set_timeout "
            f"(torch >= 2.14): keeping the init timeout instead of {timeout}"
        )

    set_pg_timeouts._muon_plugin_compat = True  # type: ignore[attr-defined]
    dist_utils.set_pg_timeouts = set_pg_timeouts
