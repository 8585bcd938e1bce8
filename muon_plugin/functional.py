"""The elementwise math of a Muon step, on lists of (local) tensors.

Written once with ``torch._foreach_*`` ops: the batched driver passes every parameter of a group
at once, the per-parameter driver passes one-element lists. DTensors are handled by the caller,
which passes their local shards: everything here is elementwise, so shards need no
communication.
"""

from __future__ import annotations

import torch
from torch import Tensor


def momentum_update_(
    grads: list[Tensor], bufs: list[Tensor], momentum: float, nesterov: bool
) -> list[Tensor]:
    """Update the momentum buffers in place and return the direction to orthogonalize.

    ``buf <- momentum * buf + (1 - momentum) * grad``; the direction is the Nesterov look-ahead
    ``grad + momentum * (buf - grad)`` or ``buf`` itself. Gradients are cast to the buffers'
    dtype (fp32 for bf16/fp16 parameters) first.
    """
    grads = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, bufs, strict=True)]
    torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
    if nesterov:
        return torch._foreach_lerp(grads, bufs, momentum)
    return bufs


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
    if weight_decay != 0.0 and lr != 0.0:
        if cautious:
            agree = torch._foreach_mul(updates, params)
            torch._foreach_sign_(agree)
            torch._foreach_clamp_min_(agree, 0.0)  # 1 where update and param agree, else 0
            torch._foreach_addcmul_(params, params, agree, value=-lr * weight_decay)
        else:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)
