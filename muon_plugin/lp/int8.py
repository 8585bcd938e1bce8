"""int8 momentum: torchao's signed 8-bit dynamic-tree codes with an fp32 absmax per block.

``momentum_codes`` (uint8, the parameter's shape) and ``momentum_scales`` (fp32, one a block:
``(*shape[:-1], shape[-1] // block_size)``): 1 + 4 / 256 = 1.016 bytes per element at the
default block of 256 (torchao's). The math is torchao's low-bit optimizer-state type: each step
wraps the local codes and scales, no copy, in ``OptimState8bit``, dequantizes with its
``dequantize()``, updates the momentum in fp32 and requantizes in place with its ``copy_``
(blockwise absmax scaling, the signed dynamic-tree map). Needs torchao (the ``lp`` extra).
On CUDA with Triton, the same math runs as one fused kernel
(:mod:`muon_plugin.kernels.quantized`): one pass over memory where eager torchao runs tens of
kernels, and one launch for all of a step's int8 momenta, whatever their shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from muon_plugin.kernels.quantized import grouped_int8_momentum_, int8_kernel_applies
from muon_plugin.lp.codec import Layout, ViewedCodec
from muon_plugin.lp.keys import CODES_KEY, SCALES_KEY
from muon_plugin.lp.runtime import table


def _signed_qmap() -> Tensor:
    # torchao builds its signed 8-bit code map in zeros(); reuse it rather than restating it.
    from torchao.optim.subclass_8bit import OptimState8bit

    return OptimState8bit.zeros((256,), signed=True, block_size=256).qmap


def quantized_update(state: Any, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Momentum step on a torchao optimizer-state tensor (dequantize, update, requantize)."""
    g = grad.float()
    buf = state.dequantize().lerp_(g, 1.0 - momentum)
    state.copy_(buf)
    return g.lerp(buf, momentum) if nesterov else buf


def blocked_layout(shape: tuple[int, ...], block_size: int, codes: torch.dtype) -> Layout:
    """Codes shaped like the parameter and an fp32 scale per block (int8, fp8)."""
    *lead, cols = shape
    return {
        CODES_KEY: (tuple(shape), codes),
        SCALES_KEY: ((*lead, cols // block_size), torch.float32),
    }


@dataclass(frozen=True)
class Int8Codec(ViewedCodec):
    """``momentum_codes`` (uint8) + ``momentum_scales`` (fp32 a block), through torchao."""

    kind: ClassVar[str] = "int8"
    keys: ClassVar[tuple[str, ...]] = (CODES_KEY, SCALES_KEY)
    update_fn = staticmethod(quantized_update)
    scales_key: ClassVar[str | None] = SCALES_KEY
    default_block_size: ClassVar[int] = 256
    needs_torchao: ClassVar[bool] = True

    def layout(self, shape: tuple[int, ...]) -> Layout:
        return blocked_layout(shape, self.block_size, torch.uint8)

    def fused_applies(
        self, state: Mapping[str, Tensor], grad: Tensor, kernels: bool | None
    ) -> bool:
        return int8_kernel_applies(state[CODES_KEY], state[SCALES_KEY], grad, kernels)

    def _fused_launch(
        self,
        states: Sequence[Mapping[str, Tensor]],
        grads: Sequence[Tensor],
        momentum: float,
        nesterov: bool,
        direction_dtype: torch.dtype,
    ) -> list[Tensor] | None:
        codes = [s[CODES_KEY] for s in states]
        scales = [s[SCALES_KEY] for s in states]
        qmap = table("int8", _signed_qmap, codes[0].device)
        return grouped_int8_momentum_(
            codes, scales, grads, qmap, momentum, nesterov, direction_dtype
        )

    def view(self, state: Mapping[str, Tensor]) -> Any:
        """The local state as torchao's ``OptimState8bit`` (1-D, sharing storage)."""
        from torchao.optim.subclass_8bit import OptimState8bit

        codes, scales = state[CODES_KEY].view(-1), state[SCALES_KEY].view(-1)
        return OptimState8bit(codes, scales, table("int8", _signed_qmap, codes.device), True)
