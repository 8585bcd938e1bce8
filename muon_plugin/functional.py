"""The elementwise math of a Muon step, on lists of (local) tensors.

Written once with ``torch._foreach_*`` ops: the batched driver passes every parameter of a group
at once, the per-parameter driver passes one-element lists. Large contiguous CUDA tensors take
the fused Triton kernels of :mod:`muon_plugin.kernels.elementwise` instead (same math, one pass
over memory). DTensors are handled by the caller, which passes their local shards: everything
here is elementwise, so shards need no communication.
"""

from __future__ import annotations

import torch
from torch import Tensor

from muon_plugin.kernels.elementwise import (
    fused_decay_update,
    fused_momentum,
    use_fused_elementwise,
)


def momentum_update_(
    grads: list[Tensor], bufs: list[Tensor], momentum: float, nesterov: bool
) -> list[Tensor]:
    """Update the momentum buffers in place and return the direction to orthogonalize.

    ``buf <- momentum * buf + (1 - momentum) * grad``; the direction is the Nesterov look-ahead
    ``grad + momentum * (buf - grad)`` or ``buf`` itself. Gradients are cast to the buffers'
    dtype (fp32 for bf16/fp16 parameters) first.
    """
    out: list[Tensor | None] = [None] * len(grads)
    rest = []
    for i, (g, b) in enumerate(zip(grads, bufs, strict=True)):
        if use_fused_elementwise(b, g):
            out[i] = fused_momentum(g, b, momentum, nesterov)
        else:
            rest.append(i)
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
    factor is already folded into ``updates``.
    """
    ps, us = [], []
    for p, u in zip(params, updates, strict=True):
        if use_fused_elementwise(p, u):
            fused_decay_update(p, u, lr, weight_decay, cautious)
        else:
            ps.append(p)
            us.append(u)
    if not ps:
        return
    if weight_decay != 0.0 and lr != 0.0:
        if cautious:
            agree = torch._foreach_mul(us, ps)
            torch._foreach_sign_(agree)
            torch._foreach_clamp_min_(agree, 0.0)  # 1 where update and param agree, else 0
            torch._foreach_addcmul_(ps, ps, agree, value=-lr * weight_decay)
        else:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_add_(ps, us, alpha=-lr)
