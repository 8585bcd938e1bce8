"""Triton kernel for int8 Muon momentum: dequantize, momentum step and requantize in one pass.

The state is torchao's 8-bit optimizer state (``OptimState8bit``): uint8 codes into a signed
256-level dynamic-tree map and an fp32 absmax per block of ``BS`` consecutive elements. Eager
torchao runs this step as about forty kernels over int64 temporaries; here one program handles
``ROWS`` whole blocks, reading grad, codes and scales once and writing codes, scales and the
fp32 direction once (10 bytes per element with an fp32 grad).

The math is torchao's, operation for operation: ``qmap[codes] * scale``; Muon's
``buf.lerp_(grad, 1 - momentum)`` (ATen's lerp, fused multiply-add); the new scale
``amax(|buf|).clip(1e-12)``; ``buf / scale`` correctly rounded; the branchless binary search
for the largest level <= x and torchao's round-up test; the direction ``grad.lerp(buf,
momentum)`` (Nesterov) or ``buf``.

Imports triton at top level: reach it only through ``muon_plugin.kernels.quantized``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muon_plugin.kernels._elementwise_triton import _TL_DTYPES, _lerp

TILE = 4096
"""Elements per program (``ROWS`` blocks of ``BS``; one block where a block is larger)."""


@triton.jit
def _search_step(x, qmap_ptr, codes, HALF: tl.constexpr):
    """One step of the branchless binary search: move up by ``HALF`` where x >= that level."""
    return codes + tl.where(x >= tl.load(qmap_ptr + codes + HALF), HALF, 0)


@triton.jit
def _int8_momentum_kernel(
    codes_ptr,
    scales_ptr,
    grad_ptr,
    dir_ptr,
    qmap_ptr,
    n_blocks,
    w,
    m,
    NESTEROV: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_blocks
    offs = rows[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = row_mask[:, None]
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    buf = _lerp(tl.load(qmap_ptr + codes) * scale[:, None], g, w)

    new_scale = tl.maximum(tl.max(tl.abs(buf), axis=1), 1e-12)
    x = tl.math.div_rn(buf, tl.broadcast_to(new_scale[:, None], (ROWS, BS)))
    q = tl.where(x >= tl.load(qmap_ptr + 128), 128, 0)
    q = _search_step(x, qmap_ptr, q, 64)
    q = _search_step(x, qmap_ptr, q, 32)
    q = _search_step(x, qmap_ptr, q, 16)
    q = _search_step(x, qmap_ptr, q, 8)
    q = _search_step(x, qmap_ptr, q, 4)
    q = _search_step(x, qmap_ptr, q, 2)
    q = _search_step(x, qmap_ptr, q, 1)
    up = tl.minimum(q + 1, 255)
    down_level = tl.load(qmap_ptr + q)
    up_level = tl.load(qmap_ptr + up)
    q = tl.where(x - down_level >= (up_level - down_level) * 0.5, up, q)

    tl.store(codes_ptr + offs, q.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + rows, new_scale, mask=row_mask)
    if NESTEROV:
        direction = _lerp(g, buf, m)
    else:
        direction = buf
    tl.store(dir_ptr + offs, direction, mask=mask)


def int8_momentum(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    qmap: torch.Tensor,
    momentum: float,
    nesterov: bool,
) -> torch.Tensor:
    """One launch: Muon's momentum step on int8 state, in place; the fp32 direction (grad's
    shape). Contiguous tensors on one device; ``codes.numel() / scales.numel()`` (the block
    size) a power of two."""
    n_blocks = scales.numel()
    direction = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    if n_blocks == 0:
        return direction
    block = codes.numel() // n_blocks
    rows = max(1, TILE // block)
    assert grad.dtype in _TL_DTYPES
    _int8_momentum_kernel[(triton.cdiv(n_blocks, rows),)](
        codes,
        scales,
        grad,
        direction,
        qmap,
        n_blocks,
        1.0 - momentum,
        momentum,
        NESTEROV=nesterov,
        BS=block,
        ROWS=rows,
    )
    return direction
