"""The Triton kernel behind :mod:`muon_plugin.kernels.matrix_scale` (imported only with triton).

One program scales one block of one matrix of a contiguous batch in place. The factor is read
per matrix and rounded to the batch's dtype first, then each element is multiplied in fp32 and
rounded once: what ``X.mul_(factor.to(X.dtype))`` computes, so results are bit for bit torch's.
In ``PRESCALE`` mode the factor is derived from the matrix's max-abs instead (a power of two for
a max-abs above ``above`` or below ``below`` and not zero, its exponent at most ``max_exp``),
and a matrix with factor 1 is masked out entirely (no loads or stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
_MAX_BATCH = 65535  # the grid's second dimension

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _scale_matrices_kernel(
    x_ptr,
    f_ptr,
    per_matrix,
    below,
    above,
    max_exp,
    X_TY: tl.constexpr,
    PRESCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    blk = tl.program_id(0)
    b = tl.program_id(1)
    f = tl.load(f_ptr + b).to(tl.float32)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    end = per_matrix
    if PRESCALE:
        # f is the max-abs here: a power of two brings it into [1, 2)
        scaled = (f > above) | ((f < below) & (f > 0.0))
        f = tl.where(scaled, tl.exp2(tl.minimum(-tl.floor(tl.log2(f)), max_exp)), 1.0)
        end = tl.where(scaled, per_matrix, 0)  # a matrix left as it is is not touched
    mask = offs < end
    f = f.to(X_TY).to(tl.float32)
    base = x_ptr + b.to(tl.int64) * per_matrix
    x = tl.load(base + offs, mask=mask)
    tl.store(base + offs, (x.to(tl.float32) * f).to(X_TY), mask=mask)


def launchable(X: torch.Tensor) -> bool:
    """A contiguous fp32/bf16/fp16 batch the grid can cover."""
    return (
        X.dtype in _TL_DTYPES
        and X.is_contiguous()
        and X.dim() >= 2
        and 0 < X.numel()
        and X.numel() // X.shape[0] < 2**31
        and X.shape[0] <= _MAX_BATCH
    )


def scale_matrices_(
    X: torch.Tensor,
    values: torch.Tensor,
    band: tuple[float, float] | None,
    max_exp: int,
) -> None:
    """Per matrix ``b`` of ``X`` (``B, ...``): ``X[b] *= values[b]`` (rounded to X's dtype), or,
    with ``band = (below, above)``, ``X[b] *= 2^min(-floor(log2(values[b])), max_exp)`` where
    ``values[b]`` (its max-abs) exceeds ``above`` or is below ``below`` and not zero."""
    batch = X.shape[0]
    per_matrix = X.numel() // batch
    grid = (triton.cdiv(per_matrix, BLOCK), batch)
    _scale_matrices_kernel[grid](
        X,
        values.reshape(batch),
        per_matrix,
        0.0 if band is None else float(band[0]),
        0.0 if band is None else float(band[1]),
        float(max_exp),
        X_TY=_TL_DTYPES[X.dtype],
        PRESCALE=band is not None,
        BLOCK=BLOCK,
    )
