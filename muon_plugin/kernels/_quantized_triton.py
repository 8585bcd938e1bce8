"""Triton kernel for int8 Muon momentum: dequantize, momentum step and requantize in one pass.

The state is torchao's 8-bit optimizer state (``OptimState8bit``): uint8 codes into a signed
256-level dynamic-tree map and an fp32 absmax per block of ``BS`` consecutive elements. Eager
torchao runs this step as about forty kernels over int64 temporaries; here one launch covers a
whole list of momenta of any shapes (the grouped tables of ``_elementwise_triton``: a
``TILE``-element tile per program, ``ROWS`` whole blocks of one tensor), reading grad, codes
and scales once and writing codes, scales and the direction once (8 bytes per element with an
fp32 grad and a bf16 direction).

The math is torchao's, operation for operation: ``qmap[codes] * scale``; Muon's
``buf.lerp_(grad, 1 - momentum)`` (ATen's lerp, fused multiply-add); the new scale
``amax(|buf|).clip(1e-12)``; ``buf / scale`` correctly rounded; the branchless binary search
for the largest level <= x and torchao's round-up test; the direction ``grad.lerp(buf,
momentum)`` (Nesterov) or ``buf``, in fp32 or rounded once to bf16.

Imports triton at top level: reach it only through ``muon_plugin.kernels.quantized``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from muon_plugin.kernels._elementwise_triton import _TL_DTYPES, BLOCK, _lerp, _program_tile, _tables

TILE = BLOCK
"""Elements per program (``ROWS`` blocks of ``BS``): the grouped tables' tile, so a tensor of
``n`` elements takes ``cdiv(n, TILE)`` programs."""


@triton.jit
def _search_step(x, qmap_ptr, codes, HALF: tl.constexpr):
    """One step of the branchless binary search: move up by ``HALF`` where x >= that level."""
    return codes + tl.where(x >= tl.load(qmap_ptr + codes + HALF), HALF, 0)


@triton.jit
def _requantize(buf, qmap_ptr, ROWS: tl.constexpr, BS: tl.constexpr):
    """torchao's blockwise requantization of ``buf`` (``ROWS x BS``): the new scales and codes."""
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
    return new_scale, q


@triton.jit
def _grouped_int8_momentum_kernel(
    meta_ptr,
    tiles_ptr,
    dir_ptr,
    qmap_ptr,
    w,
    m,
    G_TY: tl.constexpr,
    D_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    NESTEROV: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
):
    row, n, start = _program_tile(meta_ptr, tiles_ptr, 6, ROWS * BS)
    g_base = tl.load(row).to(tl.pointer_type(G_TY))
    c_base = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
    d_off = tl.load(row + 4)
    s_base = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # the hint goes on the pointers: an int-to-pointer cast drops it
        g_base = tl.multiple_of(g_base, 16)
        c_base = tl.multiple_of(c_base, 16)
        d_off = tl.multiple_of(d_off, 8)
    blocks = start // BS + tl.arange(0, ROWS)
    block_mask = blocks < n // BS
    offs = blocks[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = block_mask[:, None]
    codes = tl.load(c_base + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(s_base + blocks, mask=block_mask, other=0.0)
    g = tl.load(g_base + offs, mask=mask, other=0.0).to(tl.float32)
    buf = _lerp(tl.load(qmap_ptr + codes) * scale[:, None], g, w)

    new_scale, q = _requantize(buf, qmap_ptr, ROWS, BS)
    tl.store(c_base + offs, q.to(tl.uint8), mask=mask)
    tl.store(s_base + blocks, new_scale, mask=block_mask)
    if NESTEROV:
        direction = _lerp(g, buf, m)
    else:
        direction = buf
    tl.store(dir_ptr + d_off + offs, direction.to(D_TY), mask=mask)


def grouped_int8_momentum(
    codes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    qmap: torch.Tensor,
    momentum: float,
    nesterov: bool,
    direction_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One launch: Muon's momentum step on every int8 state of the lists, in place; the
    directions (``direction_dtype``, shaped like the codes and grads). Contiguous tensors on
    one device, one grad dtype, one block size (``codes[i].numel() / scales[i].numel()``, a
    power of two of at most ``TILE``)."""
    if not grads:
        return []
    block = codes[0].numel() // scales[0].numel()
    layout, meta, aligned = _tables(grads, codes, with_dir=True, extra=scales)
    flat = torch.empty(layout.dir_numel, dtype=direction_dtype, device=codes[0].device)
    if layout.n_tiles:
        _grouped_int8_momentum_kernel[(layout.n_tiles,)](
            meta,
            layout.tiles,
            flat,
            qmap,
            1.0 - momentum,
            momentum,
            G_TY=_TL_DTYPES[grads[0].dtype],
            D_TY=_TL_DTYPES[direction_dtype],
            ALIGNED=aligned,
            NESTEROV=nesterov,
            BS=block,
            ROWS=TILE // block,
        )
    return layout.directions(flat)
