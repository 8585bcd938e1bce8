"""NorMuon's per-row factors from the rows' sums of squares, in one Triton launch per stack.

:func:`~muon_plugin.orthogonalize.normuon.row_factors_` is the math in torch vector ops, about
fifteen small launches per shape group, which on a small model's step cost more than the math
(GPT-125M on an H100: NorMuon's step 16% over Muon's). The kernel here does the same operations
on each row block in one program; torch's ops remain the path on the CPU, without triton, where
the caller says so, and after a kernel that failed to build or launch (one warning).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from muon_plugin.kernels.fallback import FAILED, KernelFallback

_fallback = KernelFallback("NorMuon row-factor kernel")


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _row_factors_triton

    return _row_factors_triton


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
