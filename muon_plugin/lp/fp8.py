"""fp8 momentum: a bf16 rank-1 part ``u w^T`` plus the residual as e4m3 codes with an fp32
absmax / 448 per block.

``momentum_codes`` (float8_e4m3fn, the parameter's shape) and ``momentum_scales`` (fp32, one a
block) hold ``momentum - u w^T`` through torchao's ``OptimStateFp8``; ``momentum_rank1_u``
(bf16, ``(*shape[:-2], rows)``) and ``momentum_rank1_w`` (bf16, ``(*shape[:-2], cols)``) are
laid out along the parameter's rows and columns (:mod:`muon_plugin.lp.rank1`). About 1.02
bytes per element. Needs torchao (the ``lp`` extra).

Why the rank-1 part: e4m3 keeps 3 mantissa bits, so an element's rounding error is proportional
to the element, and the plain format (torchao's, e4m3 codes with an fp32 absmax / 448 per block
of 256) missed the 2% target on the H200 ``mlp`` task: +2.24% and +2.44% on data seeds 0-1 and
2-3. Muon momentum is dominated by a few directions, so fp8 stores ``u w^T`` in bf16 (one vector
pair a matrix, found by one warm-started power-iteration step a step) and the fp8 codes only the
residual, whose elements are smaller. Exact H200 simulations of the same task
(docs/performance.md): rank 1 +1.17%, rank 2 +1.04%, rank 4 +1.35%, rank 8 +0.98% / +1.66%
(seeds 0-1 / 2-3), so rank 1, the one that needs no orthogonalization of the factors. It costs 2
bytes per row and per column and, for a sharded parameter, two small all-reduces per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement

from muon_plugin.lp.codec import Layout, MomentumStep, ViewedCodec
from muon_plugin.lp.int8 import blocked_layout
from muon_plugin.lp.keys import CODES_KEY, FACTOR_KEYS, SCALES_KEY, U_KEY, W_KEY
from muon_plugin.lp.rank1 import (
    FRESH_FACTORS,
    factor_placements,
    factor_shapes,
    outer,
    power_step,
)
from muon_plugin.lp.runtime import run


def fp8_momentum(codes: Any, u: Tensor, w: Tensor, grad: Tensor, momentum: float) -> Tensor:
    """``lerp(codes + u w^T, grad, 1 - momentum)`` in fp32, grad's shape."""
    dense = codes.dequantize().view(grad.shape) + outer(u, w)
    return dense.lerp_(grad.float(), 1.0 - momentum)


def fp8_store(
    codes: Any,
    u: Tensor,
    w: Tensor,
    buf: Tensor,
    grad: Tensor,
    momentum: float,
    nesterov: bool,
) -> Tensor:
    """Requantize the residual ``buf - u w^T`` (u, w already bf16) into the fp8 codes; return
    the direction."""
    codes.copy_((buf - outer(u, w)).view(-1))
    return grad.float().lerp(buf, momentum) if nesterov else buf


@dataclass(frozen=True)
class Fp8Codec(ViewedCodec):
    """e4m3 ``momentum_codes`` + fp32 ``momentum_scales`` of the residual, and the bf16 rank-1
    factors ``momentum_rank1_u`` / ``momentum_rank1_w``."""

    kind: ClassVar[str] = "fp8"
    keys: ClassVar[tuple[str, ...]] = (CODES_KEY, SCALES_KEY, U_KEY, W_KEY)
    communicates: ClassVar[bool] = True  # the rank-1 power step
    scales_key: ClassVar[str | None] = SCALES_KEY
    default_block_size: ClassVar[int] = 256
    needs_torchao: ClassVar[bool] = True
    fresh: ClassVar[Mapping[str, float]] = FRESH_FACTORS
    """``w`` starts at ones, the power iteration's first vector (``u = 0``: a zero momentum)."""

    def layout(self, shape: tuple[int, ...]) -> Layout:
        factors = {k: (s, torch.bfloat16) for k, s in factor_shapes(tuple(shape)).items()}
        return {**blocked_layout(shape, self.block_size, torch.float8_e4m3fn), **factors}

    def placements(self, p: DTensor, key: str) -> tuple[Placement, ...]:
        """The codes and scales like ``p``; ``u`` along its rows, ``w`` along its columns
        (:func:`~muon_plugin.lp.rank1.factor_placements`)."""
        return factor_placements(p, key) if key in FACTOR_KEYS else tuple(p.placements)

    def view(self, state: Mapping[str, Tensor]) -> Any:
        """The local codes and scales as torchao's ``OptimStateFp8`` (1-D, sharing storage)."""
        from torchao.optim.subclass_fp8 import OptimStateFp8

        return OptimStateFp8(state[CODES_KEY].view(-1), state[SCALES_KEY].view(-1))

    def decode(self, state: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """Decoded codes + ``u w^T``."""
        dense = super().decode(state, shape)
        if dense.numel() == 0:
            return dense
        return dense + outer(state[U_KEY], state[W_KEY])

    def encode_(self, state: Mapping[str, Tensor], dense: Tensor) -> None:
        """All of ``dense`` into the codes, ``u = 0`` (the next step's power step finds the
        rank-1 part)."""
        for key in FACTOR_KEYS:
            state[key].fill_(FRESH_FACTORS[key])
        super().encode_(state, dense)

    def _update(self, state: Mapping[str, Tensor], grad: Tensor, step: MomentumStep) -> Tensor:
        """``buf = lerp(codes + u w^T, grad)``, one power step for the new ``u, w``
        (:func:`~muon_plugin.lp.rank1.power_step`, which communicates for a sharded ``param``),
        then the residual ``buf - u w^T`` requantized; returns the direction. An empty shard
        still joins the power step's collectives."""
        u, w = state[U_KEY], state[W_KEY]
        codes = self.view(state) if grad.numel() else None  # torchao's views need elements
        if codes is None:
            buf = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        else:
            buf = run(fp8_momentum, step.compiled, codes, u, w, grad, step.momentum)
        new_u, new_w = power_step(buf, w, step.param, step.stacked)
        u.copy_(new_u)
        w.copy_(new_w)
        if codes is None:
            return buf
        store = (codes, u, w, buf, grad, step.momentum, step.nesterov)
        return run(fp8_store, step.compiled, *store)
