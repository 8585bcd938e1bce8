"""Fused elementwise Muon kernels (momentum; weight decay + update), Triton on CUDA.

``torch._foreach_*`` needs four to six passes over memory for a cautious-decay Muon step; these
kernels need one each: momentum reads grad and buffer and writes buffer and a bf16 direction
(14 bytes per element for fp32 state), decay + update reads param and update and writes param
(10 bytes). They are used for large contiguous CUDA tensors; small tensors stay on the
multi-tensor ``_foreach`` path, where one launch covers many of them.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from muon_plugin.kernels.symmetric import triton_kernels_enabled

# Below this many elements a tensor is left to the multi-tensor foreach path: a Triton launch
# costs ~10 us of Python, more than a small tensor's work (measured: GPT-125M on an H200).
FUSED_MIN_NUMEL = 1 << 22


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _elementwise_triton

    return _elementwise_triton


def use_fused_elementwise(*tensors: torch.Tensor) -> bool:
    """Whether the Triton elementwise kernels should handle these same-shape tensors."""
    t = tensors[0]
    return (
        t.is_cuda
        and t.numel() >= FUSED_MIN_NUMEL
        and all(x.is_contiguous() and x.numel() == t.numel() for x in tensors)
        and triton_kernels_enabled()
    )


def fused_momentum(
    g: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Update ``buf`` in place (lerp toward ``g``) and return the bf16 direction."""
    direction = torch.empty(g.shape, dtype=torch.bfloat16, device=g.device)
    _module().momentum(g, buf, direction, momentum, nesterov)
    return direction


def fused_decay_update(
    p: torch.Tensor, u: torch.Tensor, lr: float, weight_decay: float, cautious: bool
) -> None:
    """``p <- p - lr*wd*p`` (cautious: only where ``u*p > 0``), then ``p <- p - lr*u``, in place."""
    _module().decay_update(p, u, lr, lr * weight_decay, cautious)
