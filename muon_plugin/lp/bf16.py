"""bf16 momentum: one bf16 buffer shaped like the parameter (2 bytes per element).

The format of ``state_dtype="bf16"``, and the fallback of every other format for a parameter
that cannot be blocked. Plain torch: no torchao.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from muon_plugin.lp.codec import Layout, MomentumCodec, MomentumStep
from muon_plugin.lp.keys import BUFFER_KEY
from muon_plugin.lp.runtime import run


def dense_update(state: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Momentum step on a bf16 buffer, computed in fp32 and rounded back to nearest."""
    g = grad.float()
    buf = state.float().lerp_(g, 1.0 - momentum)
    state.copy_(buf)
    return g.lerp(buf, momentum) if nesterov else buf


@dataclass(frozen=True)
class Bf16Codec(MomentumCodec):
    """``momentum_buffer``: bf16, the parameter's shape; no blocks."""

    kind: ClassVar[str] = "bf16"
    keys: ClassVar[tuple[str, ...]] = (BUFFER_KEY,)
    quantized: ClassVar[bool] = False

    @property
    def unit(self) -> int:
        return 1

    def fallback_reason(self, p: Tensor) -> str | None:
        return None

    def layout(self, shape: tuple[int, ...]) -> Layout:
        return {BUFFER_KEY: (tuple(shape), torch.bfloat16)}

    @classmethod
    def from_saved(cls, shape: tuple[int, ...], saved: Mapping[str, Tensor]) -> Bf16Codec | None:
        buf = saved.get(BUFFER_KEY)
        return cls() if buf is not None and buf.dtype == torch.bfloat16 else None

    def decode(self, state: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        return state[BUFFER_KEY].float()

    def encode_(self, state: Mapping[str, Tensor], dense: Tensor) -> None:
        state[BUFFER_KEY].copy_(dense)

    def _update(self, state: Mapping[str, Tensor], grad: Tensor, step: MomentumStep) -> Tensor:
        buf, flat = state[BUFFER_KEY].view(-1), grad.reshape(-1)
        out = run(dense_update, step.compiled, buf, flat, step.momentum, step.nesterov)
        return out.view(grad.shape)
