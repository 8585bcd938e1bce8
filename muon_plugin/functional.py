"""The elementwise math of a Muon step, on lists of (local) tensors.

The batched driver passes every parameter of a group at once, the per-parameter driver passes
one-element lists. Contiguous CUDA tensors (fp32, bf16 or fp16) go through the grouped Triton
kernels of :mod:`muon_plugin.kernels.elementwise`: one launch and one pass over memory per
same-dtype sub-list, whatever the sizes (a list mixing bf16 and fp32 parameters makes two
launches). Everything else (CPU tensors, non-contiguous ones, other dtypes, or everything with
``MUON_PLUGIN_DISABLE_TRITON=1``) takes the ``torch._foreach_*`` ops below. The kernels follow
those ops step by step (ATen's lerp formulas, fp32 math, a rounding to the storage dtype where
each foreach op rounds, fused multiply-adds where ATen's CUDA kernels get them), so the two
paths agree to within about an ulp; the one difference is that the kernels return the direction
in bf16, the dtype the orthogonalization casts it to anyway. DTensors are handled by the caller,
which passes their local shards: everything here is elementwise, so shards need no
communication.
"""

from __future__ import annotations

import torch
from torch import Tensor

from muon_plugin.kernels.elementwise import (
    grouped_decay_update,
    grouped_momentum,
    kernel_groups,
)


def momentum_update_(
    grads: list[Tensor], bufs: list[Tensor], momentum: float, nesterov: bool
) -> list[Tensor]:
    """Update the momentum buffers in place and return the direction to orthogonalize.

    ``buf <- momentum * buf + (1 - momentum) * grad`` (``buf.lerp_(grad, 1 - momentum)``); the
    direction is the Nesterov look-ahead ``grad + momentum * (buf - grad)`` or ``buf`` itself.
    Gradients are cast to the buffers' dtype (fp32 for bf16/fp16 parameters) first. On the
    kernel path the direction is a new bf16 tensor; on the foreach path it is in the buffers'
    dtype (without Nesterov: the buffer itself).
    """
    groups, rest = kernel_groups(grads, bufs)
    out: list[Tensor | None] = [None] * len(grads)
    for idx in groups:
        directions = grouped_momentum(
            [grads[i] for i in idx], [bufs[i] for i in idx], momentum, nesterov
        )
        for i, d in zip(idx, directions, strict=True):
            out[i] = d
    if rest:
        bs = [bufs[i] for i in rest]
        gs = [
            grads[i] if grads[i].dtype == bufs[i].dtype else grads[i].to(bufs[i].dtype)
            for i in rest
        ]
        torch._foreach_lerp_(bs, gs, 1.0 - momentum)
        directions = torch._foreach_lerp(gs, bs, momentum) if nesterov else bs
        for i, d in zip(rest, directions, strict=True):
            out[i] = d
    return out  # type: ignore[return-value]


def decay_and_update_(
    params: list[Tensor],
    updates: list[Tensor],
    lr: float,
    weight_decay: float,
    cautious: bool,
) -> None:
    """Decay ``p`` by ``lr*wd`` (only where update and ``p`` agree in sign if cautious), then step.

    Weight decay is decoupled and uses the group ``lr``; any shape-dependent learning-rate
    factor is already folded into ``updates``. Every op rounds to the parameter dtype, on both
    paths.
    """
    groups, rest = kernel_groups(params, updates)
    for idx in groups:
        grouped_decay_update(
            [params[i] for i in idx], [updates[i] for i in idx], lr, weight_decay, cautious
        )
    if not rest:
        return
    ps = [params[i] for i in rest]
    us = [updates[i] for i in rest]
    if weight_decay != 0.0 and lr != 0.0:
        if cautious:
            agree = torch._foreach_mul(us, ps)
            torch._foreach_sign_(agree)
            torch._foreach_clamp_min_(agree, 0.0)  # 1 where update and param agree, else 0
            torch._foreach_addcmul_(ps, ps, agree, value=-lr * weight_decay)
        else:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_add_(ps, us, alpha=-lr)
