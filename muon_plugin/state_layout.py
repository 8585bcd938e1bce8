"""Optimizer state as DTensors: wrapping local state like its parameter, and moving loaded state
onto a parameter's device and layout.

A state tensor is a plain tensor for a plain parameter, or a DTensor on the parameter's mesh
with the placements its kind gives it (MuonLP's momentum formats:
:meth:`~muon_plugin.lp.codec.MomentumCodec.placements`; NorMuon's per-row state:
:mod:`muon_plugin.row_state`), so ``state_dict()``, ``torch.save``, ``copy.deepcopy`` and DCP
handle it like any optimizer state, and a DCP checkpoint reshards it like the parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

from muon_plugin.parameters import local


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def like_param(
    p: Tensor,
    t: Tensor,
    global_shape: Sequence[int],
    placements: Sequence[Placement] | None = None,
) -> Tensor:
    """The local tensor ``t`` as a DTensor on ``p``'s mesh with ``placements`` (default:
    ``p``'s), of ``global_shape``; ``t`` itself if ``p`` is plain."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(
        t,
        p.device_mesh,
        tuple(p.placements) if placements is None else tuple(placements),
        run_check=False,
        shape=torch.Size(global_shape),
        stride=contiguous_stride(global_shape),
    )


def match_layout(p: Tensor, v: Any, placements: Sequence[Placement] | None = None) -> Any:
    """A loaded state tensor on ``p``'s device, laid out for ``p`` with ``placements`` (default:
    ``p``'s); anything else unchanged."""
    if not isinstance(v, Tensor):
        return v
    lp = local(p)
    if isinstance(p, DTensor):
        placements = tuple(p.placements) if placements is None else tuple(placements)
        if isinstance(v, DTensor):
            if tuple(v.placements) != placements or v.device_mesh != p.device_mesh:
                v = v.redistribute(p.device_mesh, placements)
            lv = v.to_local()
            if lv.device != lp.device:
                v = like_param(p, lv.to(lp.device), tuple(v.shape), placements)
            return v
        # A full tensor on every rank: keep this rank's shard, no communication.
        return distribute_tensor(v.to(lp.device), p.device_mesh, placements, src_data_rank=None)
    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.to(lp.device)
