"""Fused kernels for low-precision Muon momentum (Triton on CUDA): int8 codes with an fp32
absmax per block, torchao's format (:mod:`muon_plugin.lp.int8`).

:func:`int8_kernel_applies` says whether one momentum's tensors can take the kernel (Triton
enabled, one CUDA device, contiguous, a grad dtype the kernel reads, a power-of-two block size
of at most :data:`MAX_BLOCK`); :func:`grouped_int8_momentum_` runs it on a whole list of such
momenta in one launch, whatever their shapes. Whether kernels may run at all is the
orthogonalization backend's call, passed as ``enabled`` (None: ``MUON_PLUGIN_DISABLE_TRITON``
decides, read at the call), as for :mod:`muon_plugin.kernels.elementwise`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from muon_plugin.kernels.elementwise import KERNEL_DTYPES
from muon_plugin.kernels.symmetric import triton_available, triton_kernels_enabled

MAX_BLOCK = 4096
"""Largest block size the kernel takes (one block per program)."""


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _quantized_triton

    return _quantized_triton


# Triton's interpreter (TRITON_INTERPRET=1, read at import, as Triton itself does) runs the
# kernels on CPU tensors.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def int8_kernel_applies(
    codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, enabled: bool | None = None
) -> bool:
    """Whether :func:`grouped_int8_momentum_` takes these local state and grad tensors.

    CPU tensors qualify only under ``TRITON_INTERPRET=1`` (Triton's interpreter).
    """
    # Runs for every int8 momentum on every step: cheap attribute reads first (``.device``
    # builds an object; ``get_device()`` is an int).
    allowed = triton_kernels_enabled() if enabled is None else enabled and triton_available()
    n, n_blocks = codes.numel(), scales.numel()
    if not allowed or not n_blocks or n != grad.numel():
        return False
    block = n // n_blocks
    return (
        (codes.is_cuda or _INTERPRETED)
        and grad.get_device() == codes.get_device() == scales.get_device()
        and grad.dtype in KERNEL_DTYPES
        and scales.dtype == torch.float32
        and block * n_blocks == n
        and block & (block - 1) == 0
        and block <= MAX_BLOCK
        and codes.is_contiguous()
        and scales.is_contiguous()
        and grad.is_contiguous()
    )


def grouped_int8_momentum_(
    codes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    qmap: torch.Tensor,
    momentum: float,
    nesterov: bool,
    direction_dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """Muon's momentum step on int8 states (``codes[i]`` uint8, ``scales[i]`` fp32 a block,
    ``qmap`` the 256 fp32 levels) in place, all in one launch; returns the directions in
    ``direction_dtype`` (bf16, the dtype orthogonalization runs in, or fp32), shaped like the
    grads. Every triple must satisfy :func:`int8_kernel_applies`, with one device, one grad
    dtype and one block size across the lists."""
    return _module().grouped_int8_momentum(
        codes, scales, grads, qmap, momentum, nesterov, direction_dtype
    )
