"""Run torchtitan 0.3 on a machine without an accelerator (CPU processes talking over gloo).

:func:`apply` is called by :func:`muon_plugin.torchtitan03.activate` (never at import time).
Without an accelerator it

1. switches ``device_type`` / ``device_module`` to the CPU in every loaded torchtitan module
   and makes FSDP2 reduce with plain ``SUM`` (gloo has no ``PREMUL_SUM``): the same shims as
   for torchtitan 0.2.2, :mod:`muon_plugin.torchtitan.cpu_mode`;
2. runs FlexAttention (the only attention 0.3's language models offer besides flash-based
   ``varlen``) eagerly: torch refuses FlexAttention's backward on CPU tensors
   (``_validate_device``) and inductor has no CPU backward for it, but the eager
   implementation differentiates fine; the block masks are built eagerly too (torchtitan
   compiles ``create_block_mask``: on 2 CPU cores that made the first step of a 2-process
   debug run take 25 s instead of 4).

On a machine with an accelerator nothing is changed. Idempotent. Users need it (the CPU runs),
and it has to reach into torchtitan's and torch's modules: neither offers a public switch for
this.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["apply", "eager_flex_attention_on_cpu", "is_applied"]

_applied = False


def is_applied() -> bool:
    """Whether :func:`apply` switched torchtitan to the CPU in this process."""
    return _applied


def eager_flex_attention_on_cpu() -> None:
    """Run torchtitan's FlexAttention eagerly, and let it take CPU tensors (idempotent)."""
    import torch.nn.attention.flex_attention as flex
    from torchtitan.models.common import attention

    original = flex._validate_device
    if not getattr(original, "_muon_plugin_cpu", False):

        @functools.wraps(original)
        def _validate_device(query: Any, key: Any, value: Any) -> None:
            if query.device.type == "cpu":
                return  # the eager implementation has a CPU backward
            original(query, key, value)

        _validate_device._muon_plugin_cpu = True  # type: ignore[attr-defined]
        flex._validate_device = _validate_device

    cls = attention.FlexAttention
    if not getattr(cls._compiled_flex_attn, "_muon_plugin_cpu", False):

        def eager_flex_attention(*args: Any, **kwargs: Any) -> Any:
            return flex.flex_attention(*args, **kwargs)

        eager_flex_attention._muon_plugin_cpu = True  # type: ignore[attr-defined]
        cls._compiled_flex_attn = eager_flex_attention
    # create_attention_mask calls this module global; the eager function builds the same mask
    attention._compiled_create_block_mask = flex.create_block_mask


def apply() -> bool:
    """Switch torchtitan 0.3 to CPU + gloo when no accelerator is present.

    Returns True when the CPU mode is (now) active, False when an accelerator exists.
    """
    global _applied
    from muon_plugin.torchtitan import cpu_mode as cpu_common

    if _applied:
        return True
    if cpu_common.accelerator_available():
        return False
    import torchtitan.components.metrics  # noqa: F401  (copies device_type at import)
    import torchtitan.distributed.parallel_dims  # noqa: F401
    import torchtitan.distributed.utils  # noqa: F401
    import torchtitan.trainer  # noqa: F401

    cpu_common.apply()
    eager_flex_attention_on_cpu()
    _applied = True
    return True
