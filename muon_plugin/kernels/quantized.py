"""Fused kernels for low-precision Muon momentum (Triton on CUDA): int8 codes with an fp32
absmax per block, torchao's format (:mod:`muon_plugin.lp.int8`), and int4 mid-rise codes with
a scale code per block and a bf16 base per super-block (:mod:`muon_plugin.lp.int4`).

:func:`int8_kernel_applies` and :func:`int4_kernel_applies` say whether one momentum's tensors
can take the kernel (Triton enabled, one CUDA device, contiguous, a grad dtype the kernel reads,
a power-of-two block size the kernel tiles); :func:`grouped_int8_momentum_` and
:func:`grouped_int4_momentum_` run it on a whole list of such momenta in one launch, whatever
their shapes. Whether kernels may run at all is the orthogonalization backend's call, passed
as ``enabled`` (None: ``MUON_PLUGIN_DISABLE_TRITON`` decides, read at the call), as for
:mod:`muon_plugin.kernels.elementwise`. A kernel that fails to build or launch warns once and
says no from then on; the caller runs the torch ops (:mod:`muon_plugin.kernels.fallback`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from muon_plugin.kernels.elementwise import KERNEL_DTYPES
from muon_plugin.kernels.fallback import FAILED, KernelFallback
from muon_plugin.kernels.symmetric import triton_available, triton_kernels_enabled

MAX_BLOCK = 4096
"""Largest int8 block size the kernel takes (one block per program)."""
MAX_INT4_BLOCK = 256
"""Largest int4 block size the kernel takes (one super-block of 16 blocks per program)."""

_int8_fallback = KernelFallback("int8 momentum kernel")
_int4_fallback = KernelFallback("int4 momentum kernel")


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _quantized_triton

    return _quantized_triton


# Triton's interpreter (TRITON_INTERPRET=1, read at import, as Triton itself does) runs the
# kernels on CPU tensors.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _kernels_allowed(enabled: bool | None) -> bool:
    return triton_kernels_enabled() if enabled is None else enabled and triton_available()


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _same_device_contiguous(state: Sequence[torch.Tensor], grad: torch.Tensor) -> bool:
    """On CUDA (or in the interpreter), one device, contiguous, a grad dtype the kernels read."""
    # Runs for every quantized momentum on every step: cheap attribute reads first
    # (``.device`` builds an object; ``get_device()`` is an int).
    device = grad.get_device()
    return (
        (grad.is_cuda or _INTERPRETED)
        and grad.dtype in KERNEL_DTYPES
        and grad.is_contiguous()
        and all(t.get_device() == device and t.is_contiguous() for t in state)
    )


def int8_kernel_applies(
    codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, enabled: bool | None = None
) -> bool:
    """Whether :func:`grouped_int8_momentum_` takes these local state and grad tensors.

    CPU tensors qualify only under ``TRITON_INTERPRET=1`` (Triton's interpreter).
    """
    n, n_blocks = codes.numel(), scales.numel()
    if not _kernels_allowed(enabled) or not n_blocks or n != grad.numel() or _int8_fallback.failed:
        return False
    block = n // n_blocks
    return (
        scales.dtype == torch.float32
        and block * n_blocks == n
        and _power_of_two(block)
        and block <= MAX_BLOCK
        and _same_device_contiguous((codes, scales), grad)
    )


def int4_kernel_applies(
    codes: torch.Tensor,
    scale_codes: torch.Tensor,
    bases: torch.Tensor,
    grad: torch.Tensor,
    enabled: bool | None = None,
) -> bool:
    """Whether :func:`grouped_int4_momentum_` takes these local int4 state and grad tensors:
    besides :func:`int8_kernel_applies`' conditions, a power-of-two block of at most
    :data:`MAX_INT4_BLOCK` and whole super-blocks."""
    n, n_blocks = grad.numel(), scale_codes.numel()
    if not _kernels_allowed(enabled) or not n_blocks or _int4_fallback.failed:
        return False
    block = n // n_blocks
    return (
        block * n_blocks == n
        and _power_of_two(block)
        and block <= MAX_INT4_BLOCK
        and 2 * codes.numel() == n
        and 16 * block * bases.numel() == n
        and bases.dtype == torch.bfloat16
        and _same_device_contiguous((codes, scale_codes, bases), grad)
    )


def grouped_int8_momentum_(
    codes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    qmap: torch.Tensor,
    momentum: float,
    nesterov: bool,
    direction_dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor] | None:
    """Muon's momentum step on int8 states (``codes[i]`` uint8, ``scales[i]`` fp32 a block,
    ``qmap`` the 256 fp32 levels) in place, all in one launch; returns the directions in
    ``direction_dtype`` (bf16, the dtype orthogonalization runs in, or fp32), shaped like the
    grads. Every triple must satisfy :func:`int8_kernel_applies`, with one device, one grad
    dtype and one block size across the lists. None if the kernel failed to build or launch
    (as for :func:`grouped_int4_momentum_`)."""
    args = (codes, scales, grads, qmap, momentum, nesterov, direction_dtype)
    return _launched(_int8_fallback, "grouped_int8_momentum", args)


def _launched(fallback: KernelFallback, launcher: str, args: tuple) -> list[torch.Tensor] | None:
    """The Triton module's ``launcher(*args)``, or None if importing that module (it builds
    Triton objects at import), building the kernel or launching it failed."""
    out = fallback.run(lambda: getattr(_module(), launcher)(*args))
    return None if out is FAILED else out


def grouped_int4_momentum_(
    codes: Sequence[torch.Tensor],
    scale_codes: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    tables: tuple[torch.Tensor, torch.Tensor],
    momentum: float,
    nesterov: bool,
    direction_dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor] | None:
    """Muon's momentum step on int4 states (packed codes, scale codes, bf16 bases; ``tables``:
    the fp32 scale factors and padded midpoints of
    :func:`~muon_plugin.lp.int4.scale_tables`) in place, all in one launch; returns the
    directions in ``direction_dtype``, shaped like the grads. Every state must satisfy
    :func:`int4_kernel_applies`, with one device, one grad dtype and one block size across
    the lists. None if the kernel failed to build or launch (nothing was updated; after one
    warning :func:`int4_kernel_applies` is False from then on, and the caller runs the torch
    ops)."""
    args = (codes, scale_codes, bases, grads, *tables, momentum, nesterov, direction_dtype)
    return _launched(_int4_fallback, "grouped_int4_momentum", args)
