"""Scaling each matrix of a batch by its own factor, in place: one pass at memory speed.

The orthogonalization scales whole stacks by per-matrix factors: a power of two for the rare
matrix with huge or tiny entries (before its norm is formed), and the inverse norms folded into
its first products. As ``X.mul_(factor)`` with a ``(B, 1, 1)`` factor these are broadcasting
kernels that run at about half of memory speed, and the power-of-two pre-scaling touches every
element even where every factor is 1. The Triton kernel here streams contiguous blocks (and
skips the matrices whose pre-scaling factor is 1) with results bit for bit those of the torch
ops, which remain the path on the CPU, without triton, or where the caller says so.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from muon_plugin.kernels.fallback import FAILED, KernelFallback

_fallback = KernelFallback("per-matrix scaling kernel")


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _scale_triton

    return _scale_triton


def _use_kernel(X: torch.Tensor, kernel: bool) -> bool:
    return kernel and _fallback.ready(X) and _module().launchable(X)


def _launch(X: torch.Tensor, values: torch.Tensor, band: tuple[float, float] | None) -> bool:
    """Launch the kernel; False (after one warning) if it cannot be built or launched here."""
    launch = _module().scale_matrices_
    return _fallback.run(launch, X, values, band, max_exponent(X.dtype)) is not FAILED


def max_exponent(dtype: torch.dtype) -> int:
    """The largest ``e`` whose ``2^e`` is finite in ``dtype`` (127 for fp32 and bf16, 15 for
    fp16): the pre-scaling of a tiny matrix stops there."""
    return math.frexp(torch.finfo(dtype).max)[1] - 1


def scale_matrices_(X: torch.Tensor, factors: torch.Tensor, kernel: bool = False) -> None:
    """``X.mul_(factors.to(X.dtype))`` for a batch ``X`` (``B, ...``) and ``factors`` of ``B``
    elements (e.g. ``(B, 1, 1)``); with ``kernel``, in the Triton kernel where it applies."""
    if not (_use_kernel(X, kernel) and _launch(X, factors.float(), None)):
        _torch_scale_(X, factors)


def prescale_(X: torch.Tensor, below: float, above: float, kernel: bool = False) -> None:
    """Scale each matrix of the batch ``X`` whose max-abs exceeds ``above``, or is below
    ``below`` but not zero, by the power of two that brings its max-abs into ``[1, 2)`` (as
    far as a finite factor of X's dtype goes), in place; other matrices are left as they are.

    A power of two is exact, so this changes nothing but the magnitude (see
    ``Normalization.prescale_`` in the orthogonalization).
    """
    amax = torch.linalg.vector_norm(
        X, ord=math.inf, dim=tuple(range(1, X.dim())), dtype=torch.float32
    )
    if _use_kernel(X, kernel) and _launch(X, amax, (below, above)):
        return
    scaled = (amax > above) | ((amax < below) & (amax > 0))
    exponent = (-torch.floor(torch.log2(amax))).clamp_max(max_exponent(X.dtype))
    _torch_scale_(X, torch.where(scaled, torch.exp2(exponent), 1.0))


def _torch_scale_(X: torch.Tensor, factors: torch.Tensor) -> None:
    """``X *= factors`` per matrix, the factors rounded to X's dtype first (a same-dtype
    in-place product; a bf16 * fp32 mix would run slower)."""
    X.mul_(factors.to(X.dtype).view(-1, *([1] * (X.dim() - 1))))
