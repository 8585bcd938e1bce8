"""A Triton kernel with torch ops behind it: after its first failure to build or launch (an
unsupported GPU or Triton build) the torch ops run from then on, after one warning. The ops give
the same results, so such a failure costs speed, never a step."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from muon_plugin.kernels.symmetric import triton_available

FAILED = object()
"""What :meth:`KernelFallback.run` returns when the kernel failed."""


class KernelFallback:
    """The failure record of one kernel, named ``what`` in its warning."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures: list[str] = []

    @property
    def failed(self) -> bool:
        """Whether the kernel has failed once (then callers take the torch ops)."""
        return bool(self.failures)

    def ready(self, tensor: torch.Tensor) -> bool:
        """Whether the kernel may run on ``tensor``: on CUDA, with triton, and not failed."""
        return not self.failed and tensor.is_cuda and triton_available()

    def run(self, launch: Callable[..., Any], *args: Any) -> Any:
        """``launch(*args)``'s result, or :data:`FAILED` (after one warning) if it raised."""
        try:
            return launch(*args)
        except Exception as e:  # noqa: BLE001 - compile and launch errors of any kind
            self.failures.append(f"{type(e).__name__}: {e}")
            warnings.warn(
                f"muon_plugin: the {self.what} failed ({self.failures[0][:300]}); "
                "using torch ops instead (same results)",
                stacklevel=4,
            )
            return FAILED
