"""The Triton kernels behind :mod:`muon_plugin.kernels.row_factors` (imported only with triton).

- ``_row_sum_squares_kernel``: each row's sum of squares of a stack of orthogonalized matrices
  (bf16), accumulated in fp32; one program reduces whole rows, so each row's sum is one
  program's, in a fixed order. A plain memory-bound pass over the stack.
- ``_row_factors_kernel``: one program takes one row block of one matrix: NorMuon's steps 1-4 on
  the block's rows' sums of squares (see :mod:`muon_plugin.orthogonalize.normuon`), two passes
  over ``rows`` floats, in place of about fifteen launches of vector ops. The arithmetic is the
  torch form's, operation for operation (``lerp``'s two branches included); only the block sums
  are reduced in another order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 1024
_MAX_MATRICES = 2**31 - 1
# The row-sum kernel's tile: its rows x a chunk of their columns, 2048 elements, 4 warps. On
# GPT-125M's stacks (56.6 MB of bf16 each, 768 or 3072 columns) on an H100, timed in a CUDA
# graph as the step runs it, it reads 2.74-2.80 TB/s (20-21 us); no tile of a sweep (column
# chunks of 256-1024, 2048-16384 elements, 4-16 warps) was more than 0.6 us faster. Launched
# alone it measured 1.9 TB/s (30 us), torch's norm reduction 1.3 (42 us).
SUM_TILE = 2048
SUM_WARPS = 4


@triton.jit
def _row_sum_squares_kernel(
    x_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = r < rows
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for first in range(0, cols, BLOCK_C):
        c = first + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (c < cols)[None, :]
        x = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + r, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _row_factors_kernel(
    q_ptr,
    v_ptr,
    d_ptr,
    starts_ptr,
    sizes_ptr,
    inv_ptr,
    rms_ptr,
    m,
    weight,
    eps,
    LERP_FROM_END: tl.constexpr,
    FROBENIUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    k = tl.program_id(1)
    start = tl.load(starts_ptr + k)
    size = tl.load(sizes_ptr + k)
    inv = tl.load(inv_ptr + k)  # 1 / (cols * scale^2): q = mean square of O / scale
    base = s.to(tl.int64) * m + start
    hat = tl.zeros([BLOCK], dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(0, size, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        mask = offs < size
        q = tl.load(q_ptr + base + offs, mask=mask, other=0.0) * inv
        v = tl.load(v_ptr + base + offs, mask=mask, other=0.0)
        if LERP_FROM_END:  # torch.lerp for weights >= 0.5
            v = q - (q - v) * (1.0 - weight)
        else:
            v = v + weight * (q - v)
        tl.store(v_ptr + base + offs, v, mask=mask)
        d = 1.0 / (tl.sqrt(v) + eps)
        tl.store(d_ptr + base + offs, d, mask=mask)
        hat += tl.where(mask, d * d * q, 0.0)
        total += tl.where(mask, q, 0.0)
    hat_norm = tl.sum(hat, axis=0)
    if FROBENIUS:
        target = tl.sum(total, axis=0)
    else:
        target = tl.load(rms_ptr + k)
    zero = hat_norm == 0.0  # a zero matrix: zero factors, not 0 / 0
    gain = tl.sqrt(tl.where(zero, 0.0, target / tl.where(zero, 1.0, hat_norm)))
    for first in range(0, size, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        mask = offs < size
        d = tl.load(d_ptr + base + offs, mask=mask)
        tl.store(d_ptr + base + offs, d * gain, mask=mask)


def launchable(sum_sq: torch.Tensor, v: torch.Tensor) -> bool:
    """Contiguous fp32 ``(matrices, rows)`` sums of squares and second moments on one device."""
    return (
        sum_sq.dtype == v.dtype == torch.float32
        and sum_sq.dim() == 2
        and sum_sq.shape == v.shape
        and sum_sq.is_contiguous()
        and v.is_contiguous()
        and sum_sq.device == v.device
        and 0 < sum_sq.shape[0] <= _MAX_MATRICES
    )


def sum_launchable(X: torch.Tensor) -> bool:
    """A contiguous bf16 or fp32 ``(matrices, rows, cols)`` stack of at least one element."""
    return (
        X.dim() == 3
        and X.dtype in (torch.bfloat16, torch.float32)
        and X.is_contiguous()
        and X.numel() > 0
    )


def row_sum_squares(X: torch.Tensor) -> torch.Tensor:
    """``(matrices, rows)`` fp32: each row's sum of squares of the stack ``X``."""
    matrices, m, cols = X.shape
    out = torch.empty((matrices, m), dtype=torch.float32, device=X.device)
    block_c = _column_block(cols)
    block_r = max(1, SUM_TILE // block_c)
    rows = matrices * m
    _row_sum_squares_kernel[(triton.cdiv(rows, block_r),)](
        X, out, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=SUM_WARPS
    )
    return out


def _column_block(cols: int) -> int:
    """The column chunk of the row-sum kernel: the largest power of two of 64..256 dividing
    ``cols`` (no masked lanes), else the power of two covering it, at most 256."""
    for block in (256, 128, 64):
        if cols % block == 0:
            return block
    return min(256, triton.next_power_of_2(cols))


def row_factors_(
    sum_sq: torch.Tensor,
    v: torch.Tensor,
    blocks: list[tuple[int, int, float]],
    cols: int,
    beta2: float,
    eps: float,
    frobenius: bool,
) -> torch.Tensor:
    """The factors ``(matrices, rows)`` fp32; ``v`` updated in place, ``sum_sq`` only read."""
    matrices, m = sum_sq.shape
    starts, sizes, inv, rms = _block_table(tuple(blocks), cols, sum_sq.device)
    d = torch.empty_like(v)
    weight = 1.0 - beta2
    _row_factors_kernel[(matrices, len(blocks))](
        sum_sq,
        v,
        d,
        starts,
        sizes,
        inv,
        rms,
        m,
        weight,
        eps,
        LERP_FROM_END=weight >= 0.5,
        FROBENIUS=frobenius,
        BLOCK=BLOCK,
    )
    return d


@functools.lru_cache(maxsize=256)
def _block_table(
    blocks: tuple[tuple[int, int, float], ...], cols: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Per row block: first row, rows (int32), ``1 / (cols * scale^2)`` and the "rms" target
    ``min(rows, cols) / cols`` (fp32), on ``device``; made once per shape group."""
    return (
        torch.tensor([b[0] for b in blocks], dtype=torch.int32, device=device),
        torch.tensor([b[1] for b in blocks], dtype=torch.int32, device=device),
        torch.tensor([1.0 / (cols * b[2] * b[2]) for b in blocks], device=device),
        torch.tensor([min(b[1], cols) / cols for b in blocks], device=device),
    )
