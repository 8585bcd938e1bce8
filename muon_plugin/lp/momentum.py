"""Stage 1 of a MuonLP step: the momentum update on quantized state, batched by shape.

:data:`QUANTIZED` is the :class:`~muon_plugin.functional.MomentumStorage` MuonLP hands to
:func:`muon_plugin.functional.muon`: one :class:`QuantizedMomentum` per parameter. A step's
momenta of the same format and the same local shape and gradient dtype (and, for DTensors, the
same mesh, placements and global shape, so that every rank forms the same stacks) are updated
as one stack (:meth:`~muon_plugin.lp.codec.MomentumCodec.update_batch_`, up to
:data:`MAX_STACK_NUMEL` elements): one sequence of kernels (and of fp8's collectives) per stack
instead of one per parameter, with results equal bit for bit to updating them one at a time.
Momenta a format's fused kernel takes (int8 on CUDA) need no stacks: one launch updates all of
them in place, whatever their shapes
(:meth:`~muon_plugin.lp.codec.MomentumCodec.fused_update_`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.functional import MomentumStorage
from muon_plugin.lp.codec import MomentumCodec
from muon_plugin.lp.keys import BUFFER_KEY


@dataclass
class QuantizedMomentum:
    """The momentum of one Muon parameter as MuonLP's storage takes it: its format and local
    state tensors (updated in place)."""

    codec: MomentumCodec
    state: dict[str, Tensor]
    param: Tensor
    """The parameter (a DTensor when sharded: fp8's rank-1 step communicates over its mesh)."""
    compiled: bool

    def update_(
        self, grad: Tensor, momentum: float, nesterov: bool, kernels: bool | None = None
    ) -> Tensor:
        """Muon's momentum step on the state; the fp32 direction."""
        return self.codec.update_(
            self.state,
            grad,
            momentum,
            nesterov,
            compiled=self.compiled,
            param=self.param,
            kernels=kernels,
        )

    def batch_key(self, grad: Tensor) -> Hashable:
        """Momenta with equal keys are updated as one stack (the same on every rank)."""
        p = self.param
        layout = (p.device_mesh, tuple(p.placements), p.shape) if isinstance(p, DTensor) else None
        return self.codec, self.compiled, grad.shape, grad.dtype, grad.device, layout

    def snapshot(self) -> dict[str, Tensor]:
        """Copies of the local state tensors."""
        return {k: v.clone() for k, v in self.state.items()}

    def restore_(self, saved: dict[str, Tensor], finite: Tensor) -> None:
        """Put the snapshot back: a bf16 buffer where ``finite`` is False, codes and scales
        whole (they are restored for the whole local matrix)."""
        for key, before in saved.items():
            now = self.state[key]
            if key == BUFFER_KEY and now.shape == finite.shape:
                now.copy_(torch.where(finite, now, before))
            else:
                now.copy_(before)


MAX_STACK_NUMEL = 2**24
"""Parameter elements in one stack. The stack's temporaries (fp32 copies, torchao's int64
codes) are several bytes per element, so the cap bounds what a step needs beyond the
per-parameter update (about 0.5 GB); launches are amortized well before it, and a matrix this
large has long kernels of its own."""


def _split(idx: list[int], numels: list[int], cap: int) -> list[list[int]]:
    """``idx`` cut into consecutive runs of at most ``cap`` elements (at least one entry each)."""
    out: list[list[int]] = [[]]
    total = 0
    for i in idx:
        if out[-1] and total + numels[i] > cap:
            out.append([])
            total = 0
        out[-1].append(i)
        total += numels[i]
    return out


def batches(grads: list[Tensor], momenta: list[QuantizedMomentum]) -> list[list[int]]:
    """Positions of momenta updated together, each batch in list order, batches in the order
    of their first member; a batch holds at most :data:`MAX_STACK_NUMEL` parameter elements
    (global sizes, so every rank cuts alike)."""
    groups: dict[Hashable, list[int]] = {}
    for i, (g, m) in enumerate(zip(grads, momenta, strict=True)):
        groups.setdefault(m.batch_key(g), []).append(i)
    numels = [m.param.numel() for m in momenta]
    return [run for idx in groups.values() for run in _split(idx, numels, MAX_STACK_NUMEL)]


def fused_launches(
    grads: list[Tensor], momenta: list[QuantizedMomentum], kernels: bool | None
) -> tuple[list[list[int]], list[int]]:
    """Positions of the momenta a format's fused kernel takes, one list per launch (one codec,
    grad dtype and device; list order kept), and the positions left to the stacks."""
    launches: dict[Hashable, list[int]] = {}
    rest: list[int] = []
    for i, (g, m) in enumerate(zip(grads, momenta, strict=True)):
        if m.codec.fused_applies(m.state, g, kernels):
            launches.setdefault((m.codec, g.dtype, g.device), []).append(i)
        else:
            rest.append(i)
    return list(launches.values()), rest


def update_quantized_(
    grads: list[Tensor],
    momenta: list[QuantizedMomentum],
    momentum: float,
    nesterov: bool,
    kernels: bool | None = None,
) -> list[Tensor]:
    """Stage 1 on quantized momentum: one launch per format whose fused kernel applies (its
    directions in bf16, as MuonForeach's kernel gives them), one stack per batch for the rest
    (``kernels``: whether a format's fused Triton kernel may run, the group's orthogonalization
    backend's call)."""
    out: list[Tensor | None] = [None] * len(grads)
    launches, rest = fused_launches(grads, momenta, kernels)
    for idx in launches:
        directions = momenta[idx[0]].codec.fused_update_(
            [momenta[i].state for i in idx], [grads[i] for i in idx], momentum, nesterov
        )
        for i, direction in zip(idx, directions, strict=True):
            out[i] = direction
    rest_grads, rest_momenta = [grads[i] for i in rest], [momenta[i] for i in rest]
    for batch in batches(rest_grads, rest_momenta):
        idx = [rest[j] for j in batch]
        first = momenta[idx[0]]
        if len(idx) == 1:
            out[idx[0]] = first.update_(grads[idx[0]], momentum, nesterov, kernels)
            continue
        directions = first.codec.update_batch_(
            [momenta[i].state for i in idx],
            [grads[i] for i in idx],
            momentum,
            nesterov,
            compiled=first.compiled,
            param=first.param,
            kernels=kernels,
        )
        for i, direction in zip(idx, directions, strict=True):
            out[i] = direction
    return out  # type: ignore[return-value]


QUANTIZED = MomentumStorage(
    update_quantized_, QuantizedMomentum.snapshot, QuantizedMomentum.restore_
)
"""Stage 1 and the skip snapshots of MuonLP's momentum (one :class:`QuantizedMomentum` each)."""
