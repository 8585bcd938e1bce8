"""NorMuon's per-row factors in two Triton launches per stack: the rows' sums of squares, then
the factors from them.

:func:`~muon_plugin.orthogonalize.normuon.row_factors_` is the math in torch vector ops, about
fifteen small launches per shape group, which on a small model's step cost more than the math
(GPT-125M on an H100: NorMuon's step 16% over Muon's). The factor kernel does the same
operations on each row block in one program. The sums of squares are one memory-bound pass over
the orthogonalized stack, which the kernel reads at 1.9 TB/s on an H100 (GPT-125M's stacks: 30
us each, where torch's norm reduction took 42). torch's ops remain the path on the CPU, without
triton, where the caller says so, and after a kernel that failed to build or launch (one
warning).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from muon_plugin.kernels.fallback import FAILED, KernelFallback

_fallback = KernelFallback("NorMuon row-factor kernels")


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _row_factors_triton

    return _row_factors_triton


def row_sum_squares_kernel(X: torch.Tensor) -> torch.Tensor | None:
    """Each row's sum of squares ``(matrices, rows)`` fp32 of a contiguous stack ``X``
    (``(matrices, rows, cols)``, bf16 or fp32), by the kernel; None where it does not run."""
    if not (_fallback.ready(X) and _module().sum_launchable(X)):
        return None
    sums = _fallback.run(_module().row_sum_squares, X)
    return None if sums is FAILED else sums


def row_factors_kernel_(
    sum_sq: torch.Tensor,
    v: torch.Tensor,
    blocks: list[tuple[int, int, float]],
    cols: int,
    beta2: float,
    eps: float,
    frobenius: bool,
) -> torch.Tensor | None:
    """The factors ``(matrices, rows)`` (fp32) with ``v`` updated in place, by the kernel; None
    where it does not run (then nothing was changed): see the module docstring.

    ``blocks``: ``(first row, rows, output scale)`` per row block; ``frobenius``: the rescale
    keeps ``||O / s||_F`` (else the ``"rms"`` target ``min(rows, cols) / cols``).
    """
    if not (_fallback.ready(sum_sq) and _module().launchable(sum_sq, v)):
        return None
    factors = _fallback.run(_module().row_factors_, sum_sq, v, blocks, cols, beta2, eps, frobenius)
    return None if factors is FAILED else factors
