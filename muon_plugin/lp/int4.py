"""int4 momentum: 4-bit mid-rise codes over blocks of 16, an 8-bit log-scale code per block and
a bf16 base per super-block of 16 blocks.

``momentum_codes`` (uint8, two 4-bit codes a byte, high nibble first: ``(*shape[:-1],
shape[-1] // 2)``), ``momentum_scale_codes`` (uint8, one a block: ``(*shape[:-1], shape[-1] //
block_size)``) and ``momentum_scale_bases`` (bf16, one a super-block: ``(*shape[:-1], shape[-1]
// (16 * block_size))``): 0.5 + 1 / 16 + 2 / 256 = 0.5703 bytes per element at the default block
size 16. Plain torch arithmetic (no torchao); on CUDA with Triton, the same math as one fused
kernel for all of a step's int4 momenta (:mod:`muon_plugin.kernels.quantized`).

Each super-block (256 elements at the default) stores a ``base``: its absmax
rounded up to bf16. Each block stores an 8-bit scale code ``k``: its scale is
``base * 2**(-k / 32)`` for ``k`` in 0..254 (steps of 2.2%, a range of 245x), and ``k = 255`` marks
an all-zero block (scale 0, decoded as exact zeros). ``k`` is the nearest to the block's absmax in
the log domain, so the scale is within 2**(1/64) (1.1%) of the absmax, above or below (bf16
rounding: 0.8%); the super-block's largest block always gets ``k = 0`` (scale = base >= its
absmax), and a block below ``2**(-253.5/32)`` (1/242) of the base takes ``k = 254``. Each element
is stored as the centre of its cell of 16 equal cells spanning ``[-scale, scale]``:
``code = clamp(floor(8 * x / scale) + 8, 0, 15)``, decoded as ``(code - 7.5) / 8 * scale`` (a
uniform mid-rise map, :data:`INT4_LEVELS`; no level is 0, and elements beyond ``15/16 * scale``
take the outermost level). The scale code is decided by comparing the absmax with products
``base * midpoint`` (an fp32 table of the 254 midpoints ``2**(-(k + 0.5) / 32)``; log2 only
proposes a code, which the comparisons correct) and decoded by a table lookup (no exp2), so eager
and ``torch.compile`` code requantize the same fp32 momentum to the same state bit for bit (tested
on CPU). Two caveats: the fp32 ``lerp`` of the update itself may differ by an ulp between them
(eager CPU uses FMA, inductor's CPU code does not contract), and inductor's Triton code divides
approximately (unless ``TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1``), so an element within an ulp
of a cell edge may occasionally take the neighbouring element code.

The mid-rise top cell stores each block's largest element at about 15/16 of itself, so the
format damps the largest momentum entries a little every step: it slightly changes the
algorithm, it is not only a coarser copy of fp32 momentum. Why this format, the alternatives
measured and that caveat in numbers: docs/design/muonlp_int4.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from muon_plugin.kernels.quantized import grouped_int4_momentum_, int4_kernel_applies
from muon_plugin.lp.codec import Layout, ViewedCodec
from muon_plugin.lp.keys import BASES_KEY, CODES_KEY, SCALE_CODES_KEY
from muon_plugin.lp.runtime import table

INT4_LEVELS = tuple((2 * c - 15) / 16 for c in range(16))
"""Code ``c`` decodes to ``INT4_LEVELS[c] * scale`` = ``(c - 7.5) / 8 * scale``, the centre of
cell ``c`` of 16 equal cells spanning [-scale, scale] (a uniform mid-rise map; no level is 0 or
+-scale)."""
INT4_SUPER_BLOCK = 16
"""Blocks per super-block (one bf16 base each)."""
INT4_SCALE_STEPS = 32
"""Scale code ``k`` in 0..254 means ``base * 2**(-k / INT4_SCALE_STEPS)``."""
INT4_ZERO_SCALE = 255
"""The scale code of an all-zero block (scale 0)."""
INT4_SCALE_FACTORS = tuple(2.0 ** (-k / INT4_SCALE_STEPS) for k in range(INT4_ZERO_SCALE)) + (0.0,)
INT4_SCALE_MIDPOINTS = tuple(2.0 ** (-(k + 0.5) / INT4_SCALE_STEPS) for k in range(254))
"""The boundary between scale codes k and k + 1 (k = 0..253), in units of the base: the midpoint
of their scales in the log domain."""


def _scale_factors() -> Tensor:
    return torch.tensor(INT4_SCALE_FACTORS, dtype=torch.float32)


def _scale_midpoints() -> Tensor:
    # Entry k: the midpoint between codes k - 1 and k; inf above code 0 and 0 below 254, so that
    # an absmax is always below the first and never below the last.
    return torch.tensor((float("inf"), *INT4_SCALE_MIDPOINTS, 0.0), dtype=torch.float32)


def scale_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """The fp32 tables of :data:`INT4_SCALE_FACTORS` and the padded
    :data:`INT4_SCALE_MIDPOINTS` on ``device``."""
    return (
        table("int4-scale-factors", _scale_factors, device),
        table("int4-scale-midpoints", _scale_midpoints, device),
    )


def unpack_int4(codes: Tensor) -> Tensor:
    """The 4-bit codes (uint8, 1-D, twice as long) of packed bytes, high nibble first."""
    return torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)


def midrise_quantize(blocks: Tensor, scales: Tensor) -> Tensor:
    """Packed mid-rise codes (uint8, 1-D) of ``blocks`` (fp32, one row a block) under
    ``scales`` (fp32, one a block): the cell of each element, ``floor(8 * x / scale) + 8``
    clamped to [0, 15], i.e. the nearest level of :data:`INT4_LEVELS` times the scale (elements
    beyond ``15/16 * scale`` take the outermost). A block of scale 0 must be all zero."""
    inv = scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q = blocks.div(inv).mul_(8.0).floor_().add_(8.0).clamp_(0.0, 15.0).to(torch.uint8).view(-1)
    return (q[::2] << 4) | q[1::2]


def midrise_dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """fp32 values (1-D) of packed mid-rise codes: ``INT4_LEVELS[code] * scale``, ``scales``
    fp32, one a block."""
    centred = unpack_int4(codes).float().sub_(7.5).view(scales.numel(), -1)
    return centred.mul_(scales.mul(0.125).unsqueeze(-1)).view(-1)


def round_up_to_bf16(x: Tensor) -> Tensor:
    """The smallest bf16 value >= ``x`` (fp32, >= 0), as fp32. Done on the bits, so compiled
    code (where inductor may drop an fp32 -> bf16 -> fp32 round trip) rounds like eager."""
    return ((x.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)


def int4_scale_codes(absmax: Tensor, bases: Tensor, midpoints: Tensor) -> Tensor:
    """The scale code (uint8) of each block: ``absmax`` (fp32, one super-block a row) against
    its row's ``bases`` (fp32, shape ``(super-blocks, 1)``).

    ``k`` is the number of midpoints ``base * 2**(-(j + 0.5) / 32)`` (j = 0..253) above the
    absmax: the nearest code in the log domain, 254 below the smallest midpoint, and
    INT4_ZERO_SCALE for an all-zero block. The estimate ``round(-32 * log2(absmax / base))`` is
    within one code of it (its error is about 1e-5 of a code) but may differ by an ulp between
    eager and compiled code; comparing the absmax with the two midpoints around the estimate
    (correctly rounded fp32 products, ``midpoints[k]`` being the one between codes k - 1 and
    k) settles it, so eager and compiled code agree bit for bit.
    """
    ratio = absmax / bases.clamp_min(torch.finfo(torch.float32).tiny)
    k = ratio.log2_().mul_(-INT4_SCALE_STEPS).round_().nan_to_num_(0.0).clamp_(0, 254).long()
    k += (absmax < bases * midpoints[k + 1]).long()  # below the k | k + 1 boundary: k + 1
    k -= (absmax >= bases * midpoints[k]).long()  # not below the k - 1 | k boundary: k - 1
    return k.masked_fill_(absmax == 0, INT4_ZERO_SCALE).to(torch.uint8)


def int4_block_scales(scale_codes: Tensor, bases: Tensor, factors: Tensor) -> Tensor:
    """The fp32 scale of each block (1-D): its super-block's base times
    ``factors[code]`` = ``2**(-code / 32)`` (0 for INT4_ZERO_SCALE), a table lookup."""
    per_super = scale_codes.view(bases.numel(), -1).long()
    return (bases.float().view(-1, 1) * factors[per_super]).view(-1)


def int4_dequantize(codes: Tensor, scale_codes: Tensor, bases: Tensor, factors: Tensor) -> Tensor:
    """fp32 values (1-D) of int4 state: mid-rise codes under the decoded block scales."""
    return midrise_dequantize(codes, int4_block_scales(scale_codes, bases, factors))


def int4_quantize_(
    codes: Tensor,
    scale_codes: Tensor,
    bases: Tensor,
    factors: Tensor,
    midpoints: Tensor,
    x: Tensor,
) -> None:
    """Store ``x`` (fp32, 1-D) into int4 state: each super-block's base (its absmax rounded up
    to bf16), each block's scale code (:func:`int4_scale_codes`), and each element's mid-rise
    code under the block's decoded scale."""
    blocks = x.view(scale_codes.numel(), -1)
    absmax = blocks.abs().amax(-1).view(bases.numel(), -1)  # one super-block a row
    base = round_up_to_bf16(absmax.amax(-1, keepdim=True))
    k = int4_scale_codes(absmax, base, midpoints).view(-1)
    codes.copy_(midrise_quantize(blocks, int4_block_scales(k, base, factors)))
    scale_codes.copy_(k)
    bases.copy_(base.view(-1))  # exact: base is a bf16 value


def int4_update(
    codes: Tensor,
    scale_codes: Tensor,
    bases: Tensor,
    factors: Tensor,
    midpoints: Tensor,
    grad: Tensor,
    momentum: float,
    nesterov: bool,
) -> Tensor:
    """Momentum step on int4 state (dequantize, update in fp32, requantize in place)."""
    g = grad.float()
    buf = int4_dequantize(codes, scale_codes, bases, factors).lerp_(g, 1.0 - momentum)
    int4_quantize_(codes, scale_codes, bases, factors, midpoints, buf)
    return g.lerp(buf, momentum) if nesterov else buf


class Int4State(tuple):
    """int4 state (1-D, shared storage): packed 4-bit codes, the scale code of each block, the
    bf16 base of each super-block, and the two scale tables (:func:`scale_tables`).

    ``dequantize`` and ``copy_`` mirror torchao's optimizer-state tensors.
    """

    def __new__(cls, codes: Tensor, scale_codes: Tensor, bases: Tensor) -> Int4State:
        return super().__new__(cls, (codes, scale_codes, bases, *scale_tables(codes.device)))

    def dequantize(self) -> Tensor:
        return int4_dequantize(*self[:4])

    def copy_(self, x: Tensor) -> Int4State:
        int4_quantize_(*self, x)
        return self


@dataclass(frozen=True)
class Int4Codec(ViewedCodec):
    """``momentum_codes`` (4-bit, packed) + ``momentum_scale_codes`` (8-bit, one a block) +
    ``momentum_scale_bases`` (bf16, one a super-block of 16 blocks); plain torch."""

    kind: ClassVar[str] = "int4"
    keys: ClassVar[tuple[str, ...]] = (CODES_KEY, SCALE_CODES_KEY, BASES_KEY)
    update_fn = staticmethod(int4_update)
    scales_key: ClassVar[str | None] = SCALE_CODES_KEY
    default_block_size: ClassVar[int] = 16  # measured (module docstring)

    @classmethod
    def check_block_size(cls, size: int) -> None:
        if size % 2:
            raise ValueError(
                f"state_dtype='int4' packs two codes a byte, so block_size must be even, got {size}"
            )

    @property
    def unit(self) -> int:
        """A super-block: a row, and each shard of a sharded row, must be a multiple of it."""
        return self.block_size * INT4_SUPER_BLOCK

    def unit_name(self) -> str:
        return (
            f"{self.unit} (an int4 super-block: {INT4_SUPER_BLOCK} blocks of block_size "
            f"{self.block_size})"
        )

    def layout(self, shape: tuple[int, ...]) -> Layout:
        *lead, cols = shape
        return {
            CODES_KEY: ((*lead, cols // 2), torch.uint8),
            SCALE_CODES_KEY: ((*lead, cols // self.block_size), torch.uint8),
            BASES_KEY: ((*lead, cols // self.unit), torch.bfloat16),
        }

    def view(self, state: Mapping[str, Tensor]) -> Int4State:
        """The local state as an :class:`Int4State` (1-D, sharing storage)."""
        return Int4State(*(state[k].view(-1) for k in self.keys))

    def operands(self, state: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        return tuple(self.view(state))

    def fused_applies(
        self, state: Mapping[str, Tensor], grad: Tensor, kernels: bool | None
    ) -> bool:
        return int4_kernel_applies(*(state[k] for k in self.keys), grad, kernels)

    def _fused_launch(
        self,
        states: Sequence[Mapping[str, Tensor]],
        grads: Sequence[Tensor],
        momentum: float,
        nesterov: bool,
        direction_dtype: torch.dtype,
    ) -> list[Tensor] | None:
        codes, scale_codes, bases = ([s[k] for s in states] for k in self.keys)
        tables = scale_tables(grads[0].device)
        return grouped_int4_momentum_(
            codes, scale_codes, bases, grads, tables, momentum, nesterov, direction_dtype
        )
