"""Triton kernels for the elementwise half of a Muon step (one pass over memory each).

Imports triton at top level: reach it only through ``muon_plugin.kernels.elementwise``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _momentum_kernel(
    g_ptr, buf_ptr, dir_ptr, n, momentum, NESTEROV: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    buf = tl.load(buf_ptr + offs, mask=mask).to(tl.float32)
    buf = buf + (1.0 - momentum) * (g - buf)
    tl.store(buf_ptr + offs, buf.to(buf_ptr.dtype.element_ty), mask=mask)
    if NESTEROV:
        direction = g + momentum * (buf - g)
    else:
        direction = buf
    tl.store(dir_ptr + offs, direction.to(dir_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_update_kernel(p_ptr, u_ptr, n, lr, decay, CAUTIOUS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    if CAUTIOUS:
        p = tl.where(u * p > 0, p - decay * p, p)
    else:
        p = p - decay * p
    p = p - lr * u
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def momentum(
    g: torch.Tensor, buf: torch.Tensor, direction: torch.Tensor, m: float, nesterov: bool
) -> None:
    n = g.numel()
    _momentum_kernel[(triton.cdiv(n, BLOCK),)](
        g, buf, direction, n, m, NESTEROV=nesterov, BLOCK=BLOCK
    )


def decay_update(p: torch.Tensor, u: torch.Tensor, lr: float, decay: float, cautious: bool) -> None:
    n = p.numel()
    _decay_update_kernel[(triton.cdiv(n, BLOCK),)](
        p, u, n, lr, decay, CAUTIOUS=cautious, BLOCK=BLOCK
    )
