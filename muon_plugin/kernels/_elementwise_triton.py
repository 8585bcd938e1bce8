"""Grouped Triton kernels for the elementwise half of a Muon step (one pass over memory each).

One launch covers a whole list of contiguous tensors of any sizes (like ``multi_tensor_apply``):
the tensors are cut into ``BLOCK``-element tiles, and two small device tables say where each
tile lives: ``tiles[pid]`` is the index of the tile's tensor, and row ``t`` of ``meta`` holds
that tensor's data pointers (int64, cast to typed pointers in the kernel), its numel, its first
tile and (momentum) where its bf16 direction goes in one flat output buffer. Full tiles run
unmasked, with 16-byte accesses when every pointer of the list is 16-byte aligned; only the
last tile of a tensor is masked.

The tables depend only on the shapes, dtypes and data pointers of the lists, so they are built
once per distinct list pair and cached under exactly that key (plus device and stream; least
recently used dropped first): a list whose pointers moved gets fresh tables, never stale ones.
Building them costs one pinned host-to-device copy, no synchronization; a CUDA-graph capture
must therefore come after a warm-up call on the capturing stream (so the tables are cached).

Imports triton at top level: reach it only through ``muon_plugin.kernels.elementwise``.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 4096
# Row-scaled updates whose rows are all a multiple of this long take one factor per run of this
# many elements (loaded once, broadcast) instead of one load per element.
ROW_VEC = 8
# Data pointers aligned to this many bytes (all of a list's) let the kernel use 16-byte accesses.
_ALIGN = 16
# Cached tables, least recently used dropped first. The per-parameter driver calls with one
# tensor at a time, so the pointer cache must hold an entry per parameter (and per phase).
_MAX_LAYOUTS = 256
_MAX_POINTER_TABLES = 2048

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Rows of the int64 meta table, one per tensor of the list (built by ``_tables``):
#   momentum:       grad address, buffer address, numel, first tile, direction offset
#   decay + update: param address, update address, numel, first tile
#                   (row factors: + factors address, row length)
#   int8 momentum:  grad address, codes address, numel, first tile, direction offset,
#                   scales address (``_quantized_triton``)
#   int4 momentum:  packed codes address, grad address, numel, first tile, direction offset,
#                   scale codes address, bases address (``_quantized_triton``)


@triton.jit
def _lerp(a, b, w):
    """torch.lerp(a, b, w) for a scalar fp32 weight, as ATen computes it (fused multiply-add)."""
    diff = b - a
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, diff, a), tl.fma(w - 1.0, diff, b))


@triton.jit
def _program_tile(meta_ptr, tiles_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """This program's meta-table row (``ROW`` int64 entries per tensor), its tensor's numel,
    and the tile's first element within that tensor (int64: the table is int64)."""
    pid = tl.program_id(0)
    row = meta_ptr + tl.load(tiles_ptr + pid).to(tl.int64) * ROW
    n = tl.load(row + 2)
    start = (pid - tl.load(row + 3)) * BLOCK
    return row, n, start


@triton.jit
def _momentum_tile(
    g_ptrs,
    b_ptrs,
    d_ptrs,
    w,
    m,
    mask,
    BUF_TY: tl.constexpr,
    D_TY: tl.constexpr,
    NESTEROV: tl.constexpr,
):
    # Foreach math: the grad is cast to the buffer dtype; buf.lerp_(grad, 1 - momentum);
    # direction = grad.lerp(buf, momentum) (Nesterov) or buf; the direction is then D_TY.
    g = tl.load(g_ptrs, mask=mask).to(BUF_TY).to(tl.float32)
    b = tl.load(b_ptrs, mask=mask).to(tl.float32)
    b = _lerp(b, g, w).to(BUF_TY)
    tl.store(b_ptrs, b, mask=mask)
    if NESTEROV:
        d = _lerp(g, b.to(tl.float32), m).to(BUF_TY)
    else:
        d = b
    tl.store(d_ptrs, d.to(D_TY), mask=mask)


@triton.jit
def _grouped_momentum_kernel(
    meta_ptr,
    tiles_ptr,
    dir_ptr,
    w,
    m,
    G_TY: tl.constexpr,
    D_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    NESTEROV: tl.constexpr,
    BUF_TY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, n, start = _program_tile(meta_ptr, tiles_ptr, 5, BLOCK)
    g_addr = tl.load(row)
    b_addr = tl.load(row + 1)
    d_off = tl.load(row + 4)
    g_base = g_addr.to(tl.pointer_type(G_TY))
    b_base = b_addr.to(tl.pointer_type(BUF_TY))
    if ALIGNED:  # the hint goes on the pointers: an int-to-pointer cast drops it
        g_base = tl.multiple_of(g_base, 16)
        b_base = tl.multiple_of(b_base, 16)
        d_off = tl.multiple_of(d_off, 8)
    offs = start + tl.arange(0, BLOCK)
    g_ptrs = g_base + offs
    b_ptrs = b_base + offs
    d_ptrs = dir_ptr + d_off + offs
    if start + BLOCK <= n:  # full tile: unmasked, so the accesses vectorize
        _momentum_tile(g_ptrs, b_ptrs, d_ptrs, w, m, None, BUF_TY, D_TY, NESTEROV)
    else:
        _momentum_tile(g_ptrs, b_ptrs, d_ptrs, w, m, offs < n, BUF_TY, D_TY, NESTEROV)


@triton.jit
def _decay_update_tile(
    p_ptrs,
    u_ptrs,
    neg_lr,
    neg_decay,
    scale,
    f_ptrs,
    mask,
    f_mask,
    P_TY: tl.constexpr,
    PROD_TY: tl.constexpr,
    MODE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    # Foreach math, each op rounded to the param dtype as the foreach ops do. MODE 2 (cautious):
    # p.addcmul_(p, clamp_min(sign(u*p), 0), value=-lr*wd); MODE 1: p.mul_(1 - lr*wd);
    # MODE 0: no decay. Then p.add_(u, alpha=-lr). ROW_SCALE: u = u.float() * factor of its row
    # (``f_ptrs``: one per element, or one per run of elements, broadcast over it).
    p = tl.load(p_ptrs, mask=mask).to(tl.float32)
    u = tl.load(u_ptrs, mask=mask).to(tl.float32)
    if ROW_SCALE:
        u = u * tl.load(f_ptrs, mask=f_mask)
    if MODE == 2:
        agree = (u * p).to(PROD_TY).to(tl.float32) > 0  # the foreach product has that dtype
        p = tl.where(agree, tl.fma(neg_decay, p, p), p).to(P_TY).to(tl.float32)
    elif MODE == 1:
        p = (p * scale).to(P_TY).to(tl.float32)
    tl.store(p_ptrs, tl.fma(neg_lr, u, p).to(P_TY), mask=mask)


@triton.jit
def _grouped_decay_update_kernel(
    meta_ptr,
    tiles_ptr,
    neg_lr,
    neg_decay,
    scale,
    P_TY: tl.constexpr,
    U_TY: tl.constexpr,
    PROD_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    MODE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    ROW_VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, n, start = _program_tile(meta_ptr, tiles_ptr, 6 if ROW_SCALE else 4, BLOCK)
    p_addr = tl.load(row)
    u_addr = tl.load(row + 1)
    p_base = p_addr.to(tl.pointer_type(P_TY))
    u_base = u_addr.to(tl.pointer_type(U_TY))
    if ALIGNED:
        p_base = tl.multiple_of(p_base, 16)
        u_base = tl.multiple_of(u_base, 16)
    if ROW_VEC == 1:
        offs = start + tl.arange(0, BLOCK)
        f_runs = offs  # one factor per element
    else:  # the tile as BLOCK // ROW_VEC runs of ROW_VEC consecutive elements, each in one row
        runs = start + tl.arange(0, BLOCK // ROW_VEC) * ROW_VEC
        offs = runs[:, None] + tl.arange(0, ROW_VEC)[None, :]
        f_runs = runs[:, None]  # one factor per run, broadcast over its elements
    p_ptrs = p_base + offs
    u_ptrs = u_base + offs
    f_ptrs = u_ptrs  # unused without ROW_SCALE
    if ROW_SCALE:  # one factor per row of row_len consecutive elements
        f_base = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        row_len = tl.load(row + 5)
        # The tile's first row once per program (a 64-bit division), then each element's (or
        # run's) row from its offset within that row's start: under BLOCK + row_len, a 32-bit
        # division.
        first = start // row_len
        local = (f_runs - first * row_len).to(tl.int32)
        f_ptrs = f_base + first + local // row_len.to(tl.int32)
    if start + BLOCK <= n:
        _decay_update_tile(
            p_ptrs, u_ptrs, neg_lr, neg_decay, scale, f_ptrs, None, None, P_TY, PROD_TY, MODE,
            ROW_SCALE,
        )  # fmt: skip
    else:
        _decay_update_tile(
            p_ptrs, u_ptrs, neg_lr, neg_decay, scale, f_ptrs, offs < n, f_runs < n, P_TY,
            PROD_TY, MODE, ROW_SCALE,
        )  # fmt: skip


# ---------------------------------------------------------------------- tables


class _Layout:
    """Tiling of a list of shapes, and where each tensor's direction lies in one flat buffer.

    Directions are laid out shape by shape (a ``(count, *shape)`` block each, every slot
    16-byte aligned), so one ``unbind`` per distinct shape hands them all back as views.
    """

    def __init__(self, shapes: Sequence[torch.Size], device: torch.device):
        numels = [s.numel() for s in shapes]
        counts = [triton.cdiv(n, BLOCK) for n in numels]
        self.n_tiles = sum(counts)
        self.first_tile = [0] * len(shapes)
        for i in range(1, len(shapes)):
            self.first_tile[i] = self.first_tile[i - 1] + counts[i - 1]
        by_shape: dict[torch.Size, list[int]] = {}
        for i, s in enumerate(shapes):
            by_shape.setdefault(s, []).append(i)
        self.dir_offset = [0] * len(shapes)
        self.dir_blocks: list[tuple[torch.Size, list[int], int, int]] = []
        offset = 0
        for shape, idx in by_shape.items():
            slot = -(-shape.numel() // 8) * 8
            self.dir_blocks.append((shape, idx, offset, slot))
            for j, i in enumerate(idx):
                self.dir_offset[i] = offset + j * slot
            offset += len(idx) * slot
        self.dir_numel = offset
        tiles = torch.repeat_interleave(
            torch.arange(len(shapes), dtype=torch.int32), torch.tensor(counts, dtype=torch.int64)
        )
        self.tiles = _to_device(tiles, device)

    def directions(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` in list order, shaped like the layout's tensors."""
        out: list[torch.Tensor] = [flat] * len(self.dir_offset)
        for shape, idx, offset, slot in self.dir_blocks:
            if slot == shape.numel():
                views = flat[offset : offset + len(idx) * slot].view(len(idx), *shape).unbind(0)
            else:  # padded slots
                stride = torch.empty(shape, device="meta").stride()
                views = [flat.as_strided(shape, stride, offset + j * slot) for j in range(len(idx))]
            for i, v in zip(idx, views, strict=True):
                out[i] = v
        return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t
    # Pinned + non_blocking: no stream sync; the host allocator keeps the pinned block alive
    # until the copy has run.
    return t.pin_memory().to(device, non_blocking=True)


class _LRU(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or_build(self, key: Any, build: Any) -> Any:
        hit = self.get(key)
        if hit is not None:
            self.move_to_end(key)
            return hit
        value = self[key] = build()
        if len(self) > self.size:
            self.popitem(last=False)
        return value


_layouts = _LRU(_MAX_LAYOUTS)
_pointer_tables = _LRU(_MAX_POINTER_TABLES)


_shape = operator.attrgetter("shape")


def _tables(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    with_dir: bool,
    extra: Sequence[Sequence[torch.Tensor]] = (),
    row_lengths: Sequence[int] = (),
) -> tuple[_Layout, torch.Tensor, bool]:
    """The cached (layout, meta table, all pointers 16-byte aligned) of a list pair.

    ``extra``: more columns, one tensor per entry each, whose addresses end each row (the int8
    kernel's scales; the int4 kernel's scale codes and bases; the decay-update kernel's row
    factors, then followed by ``row_lengths``, its rows' lengths). The meta table is keyed on
    everything it encodes (device, dtypes, shapes, data pointers) plus the stream: tables are
    only used on the stream that copied them in (and whose pool frees them), so a list whose
    pointers moved always gets fresh tables.
    """
    device = b[0].device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    shapes = tuple(map(_shape, b))
    layout = _layouts.get_or_build((device, stream, shapes), lambda: _Layout(shapes, device))
    a_ptrs = tuple(map(torch.Tensor.data_ptr, a))
    b_ptrs = tuple(map(torch.Tensor.data_ptr, b))
    x_ptrs = tuple(tuple(map(torch.Tensor.data_ptr, column)) for column in extra)
    row_lengths = tuple(row_lengths)
    key = (
        device, stream, with_dir, a[0].dtype, b[0].dtype, shapes, a_ptrs, b_ptrs, x_ptrs,
        row_lengths,
    )  # fmt: skip

    def build() -> tuple[torch.Tensor, bool]:
        numels = [s.numel() for s in shapes]
        cols = [a_ptrs, b_ptrs, numels, layout.first_tile]
        if with_dir:
            cols.append(layout.dir_offset)
        cols.extend(x_ptrs)
        if row_lengths:
            cols.append(row_lengths)
        meta = torch.tensor(list(zip(*cols, strict=True)), dtype=torch.int64).reshape(-1)
        # Row factors are read one per row (no vector loads): their alignment does not matter.
        checked = a_ptrs + b_ptrs + (() if row_lengths else sum(x_ptrs, ()))
        aligned = all(p % _ALIGN == 0 for p in checked)
        return _to_device(meta, device), aligned

    meta, aligned = _pointer_tables.get_or_build(key, build)
    return layout, meta, aligned


def clear_caches() -> None:
    """Drop every cached table (tests; or to free the little device memory they hold)."""
    _layouts.clear()
    _pointer_tables.clear()


# ---------------------------------------------------------------------- launches


def _launch(
    kernel: triton.JITFunction,
    tables: tuple,
    operands: tuple[torch.Tensor, ...],
    grads: Sequence[torch.Tensor],
    momentum: float,
    nesterov: bool,
    direction_dtype: torch.dtype,
    **constexprs: Any,
) -> list[torch.Tensor]:
    """One grouped momentum launch over ``tables`` (``_tables``' layout, meta table and
    alignment), the kernel's lookup ``operands`` after the directions' buffer and its other
    ``constexprs``; the directions (``direction_dtype``)."""
    layout, meta, aligned = tables
    flat = torch.empty(layout.dir_numel, dtype=direction_dtype, device=grads[0].device)
    if layout.n_tiles:
        kernel[(layout.n_tiles,)](
            meta,
            layout.tiles,
            flat,
            *operands,
            1.0 - momentum,
            momentum,
            G_TY=_TL_DTYPES[grads[0].dtype],
            D_TY=_TL_DTYPES[direction_dtype],
            ALIGNED=aligned,
            NESTEROV=nesterov,
            **constexprs,
        )
    return layout.directions(flat)


def grouped_momentum(
    grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], momentum: float, nesterov: bool
) -> list[torch.Tensor]:
    """One launch: ``buf.lerp_(grad, 1 - momentum)`` for every pair; returns bf16 directions.

    The lists hold contiguous tensors of one device, one grad dtype and one buffer dtype, with
    ``grads[i].numel() == bufs[i].numel()``; directions have the shapes of ``bufs``.
    """
    if not grads:
        return []
    tables = _tables(grads, bufs, with_dir=True)
    return _launch(
        _grouped_momentum_kernel, tables, (), grads, momentum, nesterov, torch.bfloat16,
        BUF_TY=_TL_DTYPES[bufs[0].dtype], BLOCK=BLOCK,
    )  # fmt: skip


def grouped_decay_update(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    lr: float,
    weight_decay: float,
    cautious: bool,
    factors: Sequence[torch.Tensor] | None = None,
) -> None:
    """One launch: decay (cautious or not) and ``p -= lr * u`` for every pair, in place.

    The lists hold contiguous tensors of one device, one param dtype and one update dtype.
    ``factors``: per pair, contiguous fp32 factors, one per row of the update (its
    ``numel() // f.numel()`` consecutive elements): ``u`` is the update times its row's factor.
    """
    if not params:
        return
    lengths: list[int] = []
    row_vec = 1  # one factor per run of ROW_VEC elements where every row is a multiple long
    if factors is not None:
        row_vec = ROW_VEC
        for u, f in zip(updates, factors, strict=True):
            n, rows = u.numel(), f.numel()
            if f.dtype != torch.float32 or not f.is_contiguous() or n % max(1, rows):
                raise ValueError(f"row factors {tuple(f.shape)} ({f.dtype}) for {tuple(u.shape)}")
            lengths.append(n // rows if rows else 1)
            if n and lengths[-1] % ROW_VEC:
                row_vec = 1
    layout, meta, aligned = _tables(
        params, updates, with_dir=False, extra=[factors] if factors else (), row_lengths=lengths
    )
    if not layout.n_tiles:
        return
    p_dtype, u_dtype = params[0].dtype, updates[0].dtype
    if factors is not None:
        u_dtype = torch.promote_types(u_dtype, torch.float32)  # the scaled update is fp32
    mode = 0 if weight_decay == 0.0 or lr == 0.0 else (2 if cautious else 1)
    _grouped_decay_update_kernel[(layout.n_tiles,)](
        meta,
        layout.tiles,
        -lr,
        -lr * weight_decay,
        1.0 - lr * weight_decay,
        P_TY=_TL_DTYPES[p_dtype],
        U_TY=_TL_DTYPES[updates[0].dtype],
        PROD_TY=_TL_DTYPES[torch.promote_types(p_dtype, u_dtype)],
        ALIGNED=aligned,
        MODE=mode,
        ROW_SCALE=factors is not None,
        ROW_VEC=row_vec,
        BLOCK=BLOCK,
    )
