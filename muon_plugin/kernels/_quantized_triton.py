"""Triton kernels for quantized Muon momentum: dequantize, momentum step and requantize in one
pass, for int8 (torchao's format) and int4 (:mod:`muon_plugin.lp.int4`).

**int8.** The state is torchao's 8-bit optimizer state (``OptimState8bit``): uint8 codes into a
signed 256-level dynamic-tree map and an fp32 absmax per block of ``BS`` consecutive elements.
Eager torchao runs this step as about forty kernels over int64 temporaries; here one launch covers a
whole list of momenta of any shapes (the grouped tables of ``_elementwise_triton``: a
``TILE``-element tile per program, ``ROWS`` whole blocks of one tensor), reading grad, codes
and scales once and writing codes, scales and the direction once (8 bytes per element with an
fp32 grad and a bf16 direction).

The math is torchao's, operation for operation: ``qmap[codes] * scale``; Muon's
``buf.lerp_(grad, 1 - momentum)`` (ATen's lerp, fused multiply-add); the new scale
``amax(|buf|).clip(1e-12)``; ``buf / scale`` correctly rounded; the branchless binary search
for the largest level <= x and torchao's round-up test; the direction ``grad.lerp(buf,
momentum)`` (Nesterov) or ``buf``, in fp32 or rounded once to bf16.

**int4.** Packed 4-bit mid-rise codes, an 8-bit scale code per block of ``BS`` elements and a
bf16 base per super-block of 16 blocks; a program takes ``SUPERS`` whole super-blocks of one
tensor (``TILE`` elements), reading grad, codes, scale codes and bases once and writing them and
the direction once (7.1 bytes per element with an fp32 grad and a bf16 direction). The math is
:func:`muon_plugin.lp.int4.int4_update`'s, operation for operation: the block scale ``base *
factors[code]`` (a table lookup), the value ``(code - 7.5) * (scale * 0.125)``, Muon's lerp, the
super-block's base (its absmax rounded up to bf16 on the bits), each block's scale code (the
log2 estimate settled by comparisons with the midpoint table, so an estimate off by one gives
the same code), ``floor(buf / scale * 8) + 8`` clamped to [0, 15] with a correctly rounded
division, and the direction as for int8.

Imports triton at top level: reach it only through ``muon_plugin.kernels.quantized``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from muon_plugin.kernels._elementwise_triton import BLOCK, _launch, _lerp, _program_tile, _tables

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
    tables = _tables(grads, codes, with_dir=True, extra=[scales])
    return _launch(
        _grouped_int8_momentum_kernel, tables, (qmap,), grads, momentum, nesterov,
        direction_dtype, BS=block, ROWS=TILE // block,
    )  # fmt: skip


_TINY = tl.constexpr(1.1754943508222875e-38)
"""``torch.finfo(torch.float32).tiny``: the least divisor of a block scale (an all-zero block)."""


@triton.jit
def _round_up_to_bf16(x):
    """The smallest bf16 value >= ``x`` (fp32, >= 0), as fp32, on the bits (as
    :func:`muon_plugin.lp.int4.round_up_to_bf16`)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_scale_codes(absmax, base, mid_ptr):
    """Each block's scale code (int32) of its absmax (``(SUPERS, 16)``) against its super-block's
    base (``(SUPERS, 1)``), as :func:`muon_plugin.lp.int4.int4_scale_codes`."""
    est = tl.log2(tl.math.div_rn(absmax, tl.maximum(base, _TINY))) * -32.0
    est = tl.where(est == est, est, 0.0)  # NaN -> 0, as nan_to_num
    k = tl.floor(tl.minimum(tl.maximum(est, 0.0), 254.0) + 0.5).to(tl.int32)
    k += (absmax < base * tl.load(mid_ptr + k + 1)).to(tl.int32)
    k -= (absmax >= base * tl.load(mid_ptr + k)).to(tl.int32)
    return tl.where(absmax == 0.0, 255, k)


@triton.jit
def _grouped_int4_momentum_kernel(
    meta_ptr,
    tiles_ptr,
    dir_ptr,
    factors_ptr,
    mid_ptr,
    w,
    m,
    G_TY: tl.constexpr,
    D_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    NESTEROV: tl.constexpr,
    BS: tl.constexpr,
    SUPERS: tl.constexpr,
):
    UNIT: tl.constexpr = 16 * BS
    row, n, start = _program_tile(meta_ptr, tiles_ptr, 7, SUPERS * UNIT)
    c_base = tl.load(row).to(tl.pointer_type(tl.uint8))
    g_base = tl.load(row + 1).to(tl.pointer_type(G_TY))
    d_off = tl.load(row + 4)
    k_base = tl.load(row + 5).to(tl.pointer_type(tl.uint8))
    b_base = tl.load(row + 6).to(tl.pointer_type(tl.bfloat16))
    if ALIGNED:  # the hint goes on the pointers: an int-to-pointer cast drops it
        g_base = tl.multiple_of(g_base, 16)
        c_base = tl.multiple_of(c_base, 16)
        d_off = tl.multiple_of(d_off, 8)
    supers = start // UNIT + tl.arange(0, SUPERS)
    s_mask = supers < n // UNIT
    blocks = supers[:, None] * 16 + tl.arange(0, 16)[None, :]
    b_mask = s_mask[:, None]
    offs = blocks[:, :, None] * BS + tl.arange(0, BS)[None, None, :]
    mask = s_mask[:, None, None]
    g = tl.load(g_base + offs, mask=mask, other=0.0).to(tl.float32)
    packed = tl.load(c_base + offs // 2, mask=mask, other=0).to(tl.int32)
    codes = (packed >> ((1 - (offs & 1)) * 4).to(tl.int32)) & 15  # high nibble first
    base = tl.load(b_base + supers, mask=s_mask, other=0.0).to(tl.float32)
    k = tl.load(k_base + blocks, mask=b_mask, other=255).to(tl.int32)
    scale = base[:, None] * tl.load(factors_ptr + k)
    buf = _lerp((codes.to(tl.float32) - 7.5) * (scale * 0.125)[:, :, None], g, w)

    absmax = tl.max(tl.abs(buf), axis=2)
    new_base = _round_up_to_bf16(tl.max(absmax, axis=1))[:, None]
    k = _int4_scale_codes(absmax, new_base, mid_ptr)
    inv = tl.maximum(new_base * tl.load(factors_ptr + k), _TINY)[:, :, None]
    q = tl.floor(tl.math.div_rn(buf, tl.broadcast_to(inv, (SUPERS, 16, BS))) * 8.0) + 8.0
    q = tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32)
    pairs = tl.reshape(q, (SUPERS * UNIT // 2, 2))
    nibble = 16 - 15 * tl.arange(0, 2)  # high nibble first: x 16, x 1
    byte_offs = start // 2 + tl.arange(0, SUPERS * UNIT // 2)
    tl.store(
        c_base + byte_offs, tl.sum(pairs * nibble[None, :], axis=1).to(tl.uint8),
        mask=byte_offs < n // 2,
    )  # fmt: skip
    tl.store(k_base + blocks, k.to(tl.uint8), mask=b_mask)
    tl.store(b_base + supers, tl.reshape(new_base, (SUPERS,)).to(tl.bfloat16), mask=s_mask)
    if NESTEROV:
        direction = _lerp(g, buf, m)
    else:
        direction = buf
    tl.store(dir_ptr + d_off + offs, direction.to(D_TY), mask=mask)


def grouped_int4_momentum(
    codes: Sequence[torch.Tensor],
    scale_codes: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    factors: torch.Tensor,
    midpoints: torch.Tensor,
    momentum: float,
    nesterov: bool,
    direction_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One launch: Muon's momentum step on every int4 state of the lists, in place; the
    directions (``direction_dtype``, shaped like the grads). Contiguous tensors on one device,
    one grad dtype, one block size (``grads[i].numel() / scale_codes[i].numel()``, a power of
    two with 16 blocks to a super-block of at most ``TILE`` elements); ``factors`` and
    ``midpoints``: :func:`muon_plugin.lp.int4.scale_tables`."""
    if not grads:
        return []
    block = grads[0].numel() // scale_codes[0].numel()
    tables = _tables(codes, grads, with_dir=True, extra=[scale_codes, bases])
    return _launch(
        _grouped_int4_momentum_kernel, tables, (factors, midpoints), grads, momentum, nesterov,
        direction_dtype, BS=block, SUPERS=TILE // (16 * block),
    )  # fmt: skip
