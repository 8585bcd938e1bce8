"""Grouped elementwise Muon kernels (momentum; weight decay + update), Triton on CUDA.

``torch._foreach_*`` needs about seven passes over memory for a cautious-decay Muon step; these
kernels need one each, and one launch covers a whole list of tensors of any sizes (like
``multi_tensor_apply``): momentum reads grad and buffer and writes buffer and a bf16 direction
(14 bytes per element for fp32 state), decay + update reads param and update and writes param
(10 bytes with a bf16 update; NorMuon's per-row factors add next to nothing). They follow the
foreach ops' formulas and roundings and agree with them to within about an ulp (see
:mod:`muon_plugin.functional`); only the direction comes back in bf16, the dtype the
orthogonalization runs in anyway.

:func:`kernel_groups` picks the pairs the kernels take (contiguous CUDA tensors of fp32, bf16
or fp16, with Triton enabled) and splits them into same-device, same-dtype sub-lists, one launch
each; the per-launch tables are cached per distinct list (see ``_elementwise_triton``). Whether
the kernels may run at all is the orthogonalization backend's call
(``muon_plugin.orthogonalize.elementwise_kernels_allowed(name)``, resolved once by the driver and
passed as ``enabled``); without it, ``MUON_PLUGIN_DISABLE_TRITON`` decides, read at the call.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from types import ModuleType

import torch

from muon_plugin.kernels.symmetric import triton_available, triton_kernels_enabled

# A list of one tensor smaller than this stays on the foreach path (``kernel_groups``); where
# the update takes the foreach path, stacks smaller than this come back from the local
# orthogonalization in the param dtype (muon_plugin.distributed.executor).
FUSED_MIN_NUMEL = 1 << 22

KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
# Tests set this under TRITON_INTERPRET=1 to run the kernels on CPU tensors.
_ALLOW_CPU = False


@functools.cache
def _module() -> ModuleType:
    from muon_plugin.kernels import _elementwise_triton

    return _elementwise_triton


def kernel_groups(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], enabled: bool | None = None
) -> tuple[list[list[int]], list[int]]:
    """Split the pairs ``(a[i], b[i])`` into kernel launches and the rest.

    Returns index lists, one per launch (one device, one dtype of ``a``, one of ``b``; list
    order kept), and the indices left to the foreach path: pairs on another device type, not
    contiguous, of other dtypes or of different numels, or all of them when the kernels are
    off: ``enabled=False`` (the backend's choice), triton missing, or, with ``enabled=None``,
    ``MUON_PLUGIN_DISABLE_TRITON=1``.
    """
    allowed = triton_kernels_enabled() if enabled is None else enabled and triton_available()
    if not a or not allowed:
        return [], list(range(len(a)))
    if len(a) == 1 and a[0].numel() < FUSED_MIN_NUMEL:
        # A lone small tensor (the per-parameter driver) gains nothing from a launch of its
        # own, and its tables cost a pinned host-to-device copy whenever its pointers are new
        # (on an H200 this doubled the per-parameter GPT-125M step, 45 -> 91 ms).
        return [], [0]
    groups: dict[tuple, list[int]] = {}  # keyed on the dtypes (and device) of a pair
    rest: list[int] = []
    # This runs on every step: cheap attribute reads only (``.device`` builds an object), and
    # C-level maps for the common case of one device, all contiguous, matching numels.
    if _uniform(a, b):
        a_types, b_types = set(map(_dtype, a)), set(map(_dtype, b))
        if len(a_types) == len(b_types) == 1:  # the common case: one launch or none
            usable = a_types <= KERNEL_DTYPES and b_types <= KERNEL_DTYPES
            every = list(range(len(a)))
            return ([every], []) if usable else ([], every)
        for i, key in enumerate(zip(map(_dtype, a), map(_dtype, b), strict=True)):
            if key[0] in KERNEL_DTYPES and key[1] in KERNEL_DTYPES:
                groups.setdefault(key, []).append(i)
            else:
                rest.append(i)
        return list(groups.values()), rest
    on_cpu_too = _ALLOW_CPU
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        xt, yt = x.dtype, y.dtype
        dev = x.get_device()
        if (
            (x.is_cuda or on_cpu_too)
            and y.is_cuda == x.is_cuda
            and y.get_device() == dev
            and xt in KERNEL_DTYPES
            and yt in KERNEL_DTYPES
            and x.is_contiguous()
            and y.is_contiguous()
            and x.numel() == y.numel()
        ):
            groups.setdefault((dev, xt, yt), []).append(i)
        else:
            rest.append(i)
    return list(groups.values()), rest


_dtype = operator.attrgetter("dtype")
_is_cuda = operator.attrgetter("is_cuda")


def _uniform(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """All on one CUDA device (or CPU, if allowed), contiguous, with pairwise equal numels."""
    if len(a) != len(b):
        raise ValueError(f"lists of different lengths: {len(a)} and {len(b)}")
    devices = set(map(torch.Tensor.get_device, a))
    devices.update(map(torch.Tensor.get_device, b))
    return (
        len(devices) == 1
        and ((all(map(_is_cuda, a)) and all(map(_is_cuda, b))) or (_ALLOW_CPU and devices == {-1}))
        and all(map(torch.Tensor.is_contiguous, a))
        and all(map(torch.Tensor.is_contiguous, b))
        and list(map(torch.Tensor.numel, a)) == list(map(torch.Tensor.numel, b))
    )


def grouped_momentum(
    grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], momentum: float, nesterov: bool
) -> list[torch.Tensor]:
    """``buf.lerp_(grad, 1 - momentum)`` in place for every pair (one launch); bf16 directions.

    The direction is ``grad.lerp(buf, momentum)`` (Nesterov) or ``buf``, in bf16, shaped like
    the buffer. One group of :func:`kernel_groups` (grads first).
    """
    return _module().grouped_momentum(grads, bufs, momentum, nesterov)


def grouped_decay_update(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    lr: float,
    weight_decay: float,
    cautious: bool,
    factors: Sequence[torch.Tensor] | None = None,
) -> None:
    """``p <- p - lr*wd*p`` (cautious: only where ``u*p > 0``), then ``p <- p - lr*u``, in place.

    One launch for the whole list; one group of :func:`kernel_groups` (params first). With
    ``factors`` (NorMuon's rows' factors: per pair a contiguous fp32 tensor with one entry per
    row of ``u``, i.e. per ``u.numel() // f.numel()`` consecutive elements), ``u`` is
    ``update * factor`` in fp32, as :func:`muon_plugin.orthogonalize.normuon.scale_rows`
    computes it.
    """
    _module().grouped_decay_update(params, updates, lr, weight_decay, cautious, factors)
