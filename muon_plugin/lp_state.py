"""Low-precision Muon momentum: storage formats, the per-step update, and checkpoint conversion.

A parameter's momentum is stored in one of these formats (:class:`StateFormat`):

- ``bf16``: ``momentum_buffer``, a bf16 tensor shaped like the parameter.
- ``int8`` / ``fp8``: ``momentum_codes`` (uint8 / float8_e4m3fn, shaped like the parameter) and
  ``momentum_scales`` (fp32, one a block: shape ``(*param.shape[:-1], param.shape[-1] //
  block_size)``). fp8 also stores a rank-1 part of the momentum, ``u w^T``:
  ``momentum_rank1_u`` (bf16, ``(*param.shape[:-2], rows)``) and ``momentum_rank1_w`` (bf16,
  ``(*param.shape[:-2], cols)``); its codes hold ``momentum - u w^T`` (see below and
  :mod:`muon_plugin.lp_rank1`).
- ``int4``: ``momentum_codes`` (uint8, two 4-bit codes a byte, high nibble first: shape
  ``(*param.shape[:-1], param.shape[-1] // 2)``), ``momentum_scale_codes`` (uint8, one a block,
  shape as for ``momentum_scales``) and ``momentum_scale_bases`` (bf16, one a super-block of 16
  blocks: shape ``(*param.shape[:-1], param.shape[-1] // (16 * block_size))``): 0.5 + 1 / 16 +
  2 / 256 = 0.5703 bytes per element at the default block size 16.

Quantization blocks are ``block_size`` consecutive elements of one row (along the last dim), and
int4's super-blocks 16 consecutive blocks of one row; neither ever crosses a row. The state
tensors are plain tensors, or DTensors with exactly the parameter's mesh and placements (fp8's
``u`` and ``w``: the parameter's mesh, sharded like its rows and columns respectively), so:

- the optimizer state is plain tensors: ``state_dict()``, ``torch.save``, ``copy.deepcopy`` and
  ``torch.distributed.checkpoint`` (DCP) handle it like any other optimizer state;
- a DCP checkpoint reshards like the parameter: any layout that splits rows at super-block
  boundaries (every sharding of the leading dims, e.g. FSDP2 / HSDP / EP / colwise TP, and
  last-dim sharding into multiples of ``block_size``, of ``16 * block_size`` for int4) owns
  whole blocks and super-blocks with their scales, so saving on one layout and loading on
  another moves codes and scales and never re-blocks.

The math runs through torchao for int8 and fp8: its low-bit optimizer-state tensor types (each
step wraps the local codes and scales, no copy, in ``OptimState8bit`` / ``OptimStateFp8``,
dequantizes with their ``dequantize()``, updates the momentum in fp32 and requantizes in place
with their ``copy_``: blockwise absmax scaling, the signed dynamic-tree map for int8, e4m3 for
fp8). int4 is plain torch arithmetic, not torchao's ``OptimState4bit``. torchao is imported only
for int8 and fp8 (the ``lp`` extra).

The fp8 format. e4m3 keeps 3 mantissa bits, so an element's rounding error is proportional to the
element, and the plain format (torchao's, e4m3 codes with an fp32 absmax / 448 per block of 256)
missed the 2% target on the H200 ``mlp`` task: +2.24% and +2.44% on data seeds 0-1 and 2-3.
Muon momentum is dominated by a few directions, so fp8 now stores ``u w^T`` in bf16 (one vector
pair a matrix, found by one warm-started power-iteration step a step) and the fp8 codes only the
residual, whose elements are smaller. Exact H200 simulations of the same task (docs/performance.md):
rank 1 +1.17%, rank 2 +1.04%, rank 4 +1.35%, rank 8 +0.98% / +1.66% (seeds 0-1 / 2-3), so rank 1,
the one that needs no orthogonalization of the factors. It costs 2 bytes per row and per column
and, for a sharded parameter, two small all-reduces per step.

The int4 format. Each super-block (256 elements at the default) stores a ``base``: its absmax
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

Why this format: ``scripts/bench_lp.py``'s ``mlp`` task on the H200 (400 steps, mean of data
seeds 0 and 1, final loss against fp32-state Muon; exact simulations of each format, which
reproduce the real int4 and int4/16 runs exactly; docs/performance.md has the details):

======================================================  ===========  ==================
int4 variant                                            bytes/param  mlp vs fp32
======================================================  ===========  ==================
previous: block 32, bf16 absmax (rounded up)            0.5625       +2.78%
block 16, bf16 absmax (rounded up), over budget         0.625        +0.59%
**this one**: block 16, 8-bit log scale, nearest        0.5703       +0.67%
block 16, 8-bit log scale rounded down                  0.5703       -0.64%
block 32 + a rank-8 bf16 low-rank part                  0.582        +4.07%
block 32, subtractive dither                            0.5625       +2.63%
======================================================  ===========  ==================

Block 16 is the lever, and the 8-bit log scale keeps it within the 0.6 B budget at bf16's
precision. Rounding the scale down scored better still, but by damping more (below); nearest is
the neutral choice, the scale error symmetric and at most 1.1%.

The caveat: the mid-rise top cell stores each block's largest element at about 15/16 of itself
(15/16 of the scale, which is within 1.1% of it), so the format damps the largest momentum entries
a little every step. An earlier CPU study (docs/performance.md) found that this damping alone (fp32
momentum clipped to 15/16 of each block-32 absmax, no rounding) lowers the ``mlp`` loss by 3.2%, so
part of what the int4 rounding costs there is offset by the damping rather than removed: the format
slightly changes the algorithm, it is not only a coarser copy of fp32 momentum. With the scale
rounded to nearest that damping is about what bf16 rounding of the absmax gives; rounding it down
damps more. The same study measured the alternatives to the mid-rise map: a Gaussian Lloyd-Max map
(the format before the previous one, H200 ``mlp`` +5.64%) and a uniform map whose outermost levels
are ``+-absmax`` were 7 to 15 points worse on CPU, and stochastic rounding was never better than
round to nearest (the momentum is requantized every step, so rounding noise compounds through
``buf <- lerp(Q(buf), grad, 1 - momentum)``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muon_plugin.defaults import LP_STATE_DTYPES
from muon_plugin.lp_rank1 import (
    FACTOR_KEYS,
    FRESH_FACTORS,
    U_KEY,
    W_KEY,
    factor_placements,
    factor_shapes,
    outer,
    power_step,
)

STATE_DTYPES = LP_STATE_DTYPES
# torchao's own defaults for its low-bit Adam optimizers (int8, fp8); int4 measured (above).
DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 16, "fp8": 256}
# Like torchao's (and bitsandbytes') optimizers: smaller tensors are not worth quantizing.
MIN_QUANTIZED_NUMEL = 4096

BUFFER_KEY = "momentum_buffer"
CODES_KEY = "momentum_codes"
SCALES_KEY = "momentum_scales"  # fp32, one a block: int8, fp8 (and the Lloyd-Max legacy int4)
SCALE_CODES_KEY = "momentum_scale_codes"  # int4: uint8 scale code of each block
BASES_KEY = "momentum_scale_bases"  # int4: bf16 base of each super-block
ABSMAX_KEY = "momentum_scales_bf16"  # the previous int4 format: bf16 absmax of each block
# fp8 also stores the rank-1 factors U_KEY, W_KEY (muon_plugin.lp_rank1).
STATE_KEYS = (
    BUFFER_KEY,
    CODES_KEY,
    SCALES_KEY,
    SCALE_CODES_KEY,
    BASES_KEY,
    ABSMAX_KEY,
    *FACTOR_KEYS,
)

# The int4 formats of earlier versions: still read by load_state_dict (converted to the current
# format), never written.
# - Gaussian Lloyd-Max map, fp32 RMS scales under SCALES_KEY:
LLOYD_MAX_INT4 = "int4-lloyd-max"
# - the mid-rise map below with a bf16 absmax (rounded up) a block under ABSMAX_KEY:
ABSMAX_INT4 = "int4-bf16-absmax"
# The fp8 format of earlier versions (e4m3 codes and fp32 scales, no rank-1 part): read only.
PLAIN_FP8 = "fp8-plain"

# The state tensors of each format; a quantized format's second key holds one entry a block.
FORMAT_KEYS = {
    "bf16": (BUFFER_KEY,),
    "int8": (CODES_KEY, SCALES_KEY),
    "fp8": (CODES_KEY, SCALES_KEY, U_KEY, W_KEY),
    "int4": (CODES_KEY, SCALE_CODES_KEY, BASES_KEY),
    PLAIN_FP8: (CODES_KEY, SCALES_KEY),
    ABSMAX_INT4: (CODES_KEY, ABSMAX_KEY),
    LLOYD_MAX_INT4: (CODES_KEY, SCALES_KEY),
}

# int4 elements: code ``c`` decodes to ``INT4_LEVELS[c] * scale`` = ``(c - 7.5) / 8 * scale``,
# the centre of cell ``c`` of 16 equal cells spanning [-scale, scale] (a uniform mid-rise map; no
# level is 0 or +-scale). Shared by the current int4 format and the ABSMAX_INT4 legacy one.
INT4_LEVELS = tuple((2 * c - 15) / 16 for c in range(16))
# int4 scales: a super-block is INT4_SUPER_BLOCK blocks; a block's scale code k in 0..254 means
# ``base * 2**(-k / INT4_SCALE_STEPS)``, and INT4_ZERO_SCALE an all-zero block (scale 0).
INT4_SUPER_BLOCK = 16
INT4_SCALE_STEPS = 32
INT4_ZERO_SCALE = 255
INT4_SCALE_FACTORS = tuple(2.0 ** (-k / INT4_SCALE_STEPS) for k in range(INT4_ZERO_SCALE)) + (0.0,)
# The boundary between scale codes k and k + 1 (k = 0..253), in units of the base: the midpoint
# of their scales in the log domain.
INT4_SCALE_MIDPOINTS = tuple(2.0 ** (-(k + 0.5) / INT4_SCALE_STEPS) for k in range(254))
# The legacy Lloyd-Max format's map (read only): the 16 levels of the Lloyd-Max quantizer for a
# unit Gaussian (J. Max, 1960) over INT4_LEVEL_MAX; its fp32 scale was the block RMS *
# INT4_LEVEL_MAX.
INT4_LEVEL_MAX = 2.7326
_LLOYD_MAX_16 = (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)
LEGACY_INT4_LEVELS = tuple(
    [-v / INT4_LEVEL_MAX for v in reversed(_LLOYD_MAX_16)]
    + [v / INT4_LEVEL_MAX for v in _LLOYD_MAX_16]
)

LP_INSTALL_HINT = "pip install 'muon_plugin[lp]'"


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def require_torchao(state_dtype: str) -> None:
    """Raise a clear ImportError unless torchao's low-bit optimizer states can be imported."""
    try:
        import torchao.optim.subclass_4bit  # noqa: F401
        import torchao.optim.subclass_8bit  # noqa: F401
        import torchao.optim.subclass_fp8  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"MuonLP(state_dtype={state_dtype!r}) stores momentum with torchao's low-bit "
            f"optimizer states, and torchao cannot be imported ({e}). Install the `lp` extra: "
            f"{LP_INSTALL_HINT}  (state_dtype='bf16' works without torchao)"
        ) from e


def validate_state_dtype(state_dtype: object, block_size: object) -> int:
    """Check ``state_dtype`` and ``block_size``; return the block size to use (0 for bf16)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"unknown state_dtype {state_dtype!r}; expected one of {STATE_DTYPES}")
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0
    ):
        raise ValueError(f"block_size must be a positive integer or None, got {block_size!r}")
    if state_dtype == "bf16":
        return 0  # unused: bf16 state has no blocks
    size = DEFAULT_BLOCK_SIZES[state_dtype] if block_size is None else block_size
    if state_dtype == "int4" and size % 2:
        raise ValueError(
            f"state_dtype='int4' packs two codes a byte, so block_size must be even, got {size}"
        )
    return size


# ---------------------------------------------------------------------- formats


@dataclass(frozen=True)
class StateFormat:
    """How one parameter's momentum is stored: ``kind`` (one of STATE_DTYPES, or a format of an
    earlier version, read only), and the block size."""

    kind: str
    block_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    @property
    def keys(self) -> tuple[str, ...]:
        return FORMAT_KEYS[self.kind]

    @property
    def scales_key(self) -> str:
        """The key of the per-block scales (int4: the scale codes)."""
        return self.keys[1]

    @property
    def unit(self) -> int:
        """Elements of a row stored together (a block; an int4 super-block): a row, and each
        shard of a sharded row, must be a multiple of it."""
        if self.kind == "int4":
            return self.block_size * INT4_SUPER_BLOCK
        return self.block_size if self.quantized else 1

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each state tensor for a parameter (or shard) of ``shape``."""
        if not self.quantized:
            return {BUFFER_KEY: (shape, torch.bfloat16)}
        *lead, cols = shape
        packed = ((*lead, cols // 2), torch.uint8)
        blocks = (*lead, cols // self.block_size)
        if self.kind == "int4":
            return {
                CODES_KEY: packed,
                SCALE_CODES_KEY: (blocks, torch.uint8),
                BASES_KEY: ((*lead, cols // self.unit), torch.bfloat16),
            }
        if self.kind == ABSMAX_INT4:
            return {CODES_KEY: packed, ABSMAX_KEY: (blocks, torch.bfloat16)}
        if self.kind == LLOYD_MAX_INT4:
            return {CODES_KEY: packed, SCALES_KEY: (blocks, torch.float32)}
        if self.kind == "int8":
            return {CODES_KEY: (tuple(shape), torch.uint8), SCALES_KEY: (blocks, torch.float32)}
        fp8 = {CODES_KEY: (tuple(shape), torch.float8_e4m3fn), SCALES_KEY: (blocks, torch.float32)}
        if self.kind == PLAIN_FP8:
            return fp8
        return {**fp8, **{k: (s, torch.bfloat16) for k, s in factor_shapes(tuple(shape)).items()}}

    def zeros(self, p: Tensor) -> dict[str, Tensor]:
        """Zero momentum for ``p``: plain tensors, or DTensors laid out like ``p`` (the rank-1
        factors along its rows and columns). fp8's ``w`` starts at ones: the power iteration's
        first vector (``u = 0``, so the momentum is zero)."""
        lp = local(p)
        local_layout = self.layout(tuple(lp.shape))
        global_layout = self.layout(tuple(p.shape))
        out = {}
        for key, (shape, dtype) in local_layout.items():
            t = torch.full(shape, FRESH_FACTORS.get(key, 0.0), dtype=dtype, device=lp.device)
            out[key] = like_param(p, t, global_layout[key][0], key)
        return out

    # The methods below take the LOCAL state tensors ({key: local tensor}).

    def view(self, state: dict[str, Tensor]) -> Tensor | Int4State:
        """The local state as a torchao optimizer-state tensor, or an :class:`Int4State` (1-D,
        sharing storage)."""
        codes, scales = state[CODES_KEY].view(-1), state[self.scales_key].view(-1)
        if self.kind == "int8":
            from torchao.optim.subclass_8bit import OptimState8bit

            return OptimState8bit(codes, scales, table("int8", codes.device), True)
        if self.kind in ("fp8", PLAIN_FP8):
            from torchao.optim.subclass_fp8 import OptimStateFp8

            return OptimStateFp8(codes, scales)
        if self.kind == "int4":
            return Int4State(codes, scales, state[BASES_KEY].view(-1))
        raise ValueError(f"the {self.kind} int4 format is read only (checkpoints)")

    def read(self, state: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """The local momentum in fp32, shaped ``shape`` (the local parameter shape)."""
        if not self.quantized:
            return state[BUFFER_KEY].float()
        codes, scales = state[CODES_KEY].view(-1), state[self.scales_key].view(-1)
        if codes.numel() == 0:
            return torch.zeros(shape, dtype=torch.float32, device=codes.device)
        if self.kind == ABSMAX_INT4:
            dense = midrise_dequantize(codes, scales.float())
        elif self.kind == LLOYD_MAX_INT4:
            dense = lloyd_max_dequantize(codes, scales, table(LLOYD_MAX_INT4, codes.device))
        else:
            dense = self.view(state).dequantize()
        if self.kind == "fp8":
            return dense.view(shape) + outer(state[U_KEY], state[W_KEY])
        return dense.view(shape)

    def write(self, state: dict[str, Tensor], dense: Tensor) -> None:
        """Store ``dense`` (fp32, local parameter shape) into the local state (fp8: all of it
        in the codes, ``u = 0``; the next step's power step finds the rank-1 part)."""
        if not self.quantized:
            state[BUFFER_KEY].copy_(dense)
            return
        if self.kind == "fp8":
            for key in FACTOR_KEYS:
                state[key].fill_(FRESH_FACTORS[key])
        if dense.numel():
            self.view(state).copy_(dense.reshape(-1))

    def update(
        self,
        state: dict[str, Tensor],
        grad: Tensor,
        momentum: float,
        nesterov: bool,
        compiled: bool = False,
        param: Tensor | None = None,
    ) -> Tensor:
        """Muon's momentum step on the local state; returns the fp32 direction (grad's shape).

        ``buf <- lerp(buf, grad, 1 - momentum)`` in fp32 on the dequantized state, requantized
        in place; the direction is the Nesterov look-ahead ``lerp(grad, buf, momentum)`` or the
        fp32 ``buf`` itself, so quantization error enters only through the stored state.
        ``param`` (the parameter, a DTensor when sharded) tells fp8's rank-1 power step which
        dims are sharded; every rank of a sharded parameter must call this (it communicates).
        """
        if self.kind == "fp8":
            codes = self.view(state) if grad.numel() else None  # torchao's views need elements
            factors = state[U_KEY], state[W_KEY]
            return fp8_update(codes, *factors, grad, momentum, nesterov, param, compiled)
        if grad.numel() == 0:
            return torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        if self.kind == "int4":
            fn, held = int4_update, tuple(self.view(state))
        elif self.quantized:
            fn, held = quantized_update, (self.view(state),)
        else:
            fn, held = dense_update, (state[BUFFER_KEY].view(-1),)
        return run(fn, compiled, *held, grad.reshape(-1), momentum, nesterov).view(grad.shape)


class Int4State(tuple):
    """int4 state (1-D, shared storage): packed 4-bit codes, the scale code of each block, the
    bf16 base of each super-block, and the two scale tables (:func:`table`).

    ``dequantize`` and ``copy_`` mirror torchao's optimizer-state tensors, so
    :class:`StateFormat` treats every quantized kind alike.
    """

    def __new__(cls, codes: Tensor, scale_codes: Tensor, bases: Tensor) -> Int4State:
        device = codes.device
        tables = (table("int4-scale-factors", device), table("int4-scale-midpoints", device))
        return super().__new__(cls, (codes, scale_codes, bases, *tables))

    def dequantize(self) -> Tensor:
        return int4_dequantize(*self[:4])

    def copy_(self, x: Tensor) -> Int4State:
        int4_quantize_(*self, x)
        return self


def run(fn, compiled: bool, *args: Any) -> Any:
    """``fn(*args)``, compiled (:func:`compiled_update`) when ``compiled``."""
    if not compiled:
        return fn(*args)
    # One graph per distinct size (static shapes: inductor's CPU codegen can stall on the
    # symbolic block indexing of dynamic ones); a model has few distinct sizes.
    from torch._dynamo.utils import disable_cache_limit

    with disable_cache_limit():
        return compiled_update(fn)(*args)


def quantized_update(state: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Momentum step on a torchao optimizer-state tensor (dequantize, update, requantize)."""
    g = grad.float()
    buf = state.dequantize().lerp_(g, 1.0 - momentum)
    state.copy_(buf)
    return g.lerp(buf, momentum) if nesterov else buf


def dense_update(state: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Momentum step on a bf16 buffer, computed in fp32 and rounded back to nearest."""
    g = grad.float()
    buf = state.float().lerp_(g, 1.0 - momentum)
    state.copy_(buf)
    return g.lerp(buf, momentum) if nesterov else buf


# ---------------------------------------------------------------------- fp8


def fp8_update(
    codes: Tensor | None,
    u: Tensor,
    w: Tensor,
    grad: Tensor,
    momentum: float,
    nesterov: bool,
    param: Tensor | None,
    compiled: bool,
) -> Tensor:
    """Momentum step on fp8 state (torchao ``codes``, local factors ``u``, ``w``):
    ``buf = lerp(codes + u w^T, grad)``, one power step for the new ``u, w``
    (:func:`muon_plugin.lp_rank1.power_step`), then the residual ``buf - u w^T`` requantized;
    returns the direction. An empty shard (``codes`` None) still joins the power step's
    collectives."""
    empty = codes is None
    if empty:
        buf = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
    else:
        buf = run(fp8_momentum, compiled, codes, u, w, grad, momentum)
    new_u, new_w = power_step(buf, w, param)
    u.copy_(new_u)
    w.copy_(new_w)
    if empty:
        return buf
    return run(fp8_store, compiled, codes, u, w, buf, grad, momentum, nesterov)


def fp8_momentum(codes: Tensor, u: Tensor, w: Tensor, grad: Tensor, momentum: float) -> Tensor:
    """``lerp(codes + u w^T, grad, 1 - momentum)`` in fp32, grad's shape."""
    dense = codes.dequantize().view(grad.shape) + outer(u, w)
    return dense.lerp_(grad.float(), 1.0 - momentum)


def fp8_store(
    codes: Tensor,
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


# ---------------------------------------------------------------------- int4


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


def lloyd_max_dequantize(codes: Tensor, scales: Tensor, qmap: Tensor) -> Tensor:
    """fp32 values (1-D) of the legacy Lloyd-Max int4 format: ``qmap[code] * scale``."""
    values = qmap[unpack_int4(codes).long()].view(scales.numel(), -1)
    return (values * scales.view(-1, 1)).view(-1)


@functools.cache
def compiled_update(fn):
    """``fn`` under ``torch.compile`` (static shapes, the whole update in one graph)."""
    # torch warns once per torchao subclass about AOT-autograd cache keys; it is harmless here.
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    return torch.compile(fn, fullgraph=True, dynamic=False)


@functools.cache
def _table_cpu(name: str) -> Tensor:
    if name == "int4-scale-factors":
        return torch.tensor(INT4_SCALE_FACTORS, dtype=torch.float32)
    if name == "int4-scale-midpoints":
        # Entry k: the midpoint between codes k - 1 and k; inf above code 0 and 0 below 254, so
        # that an absmax is always below the first and never below the last.
        padded = (float("inf"), *INT4_SCALE_MIDPOINTS, 0.0)
        return torch.tensor(padded, dtype=torch.float32)
    if name == LLOYD_MAX_INT4:
        return torch.tensor(LEGACY_INT4_LEVELS, dtype=torch.float32)
    if name == "int8":
        # torchao builds its signed 8-bit code map in zeros(); reuse it rather than restating it.
        from torchao.optim.subclass_8bit import OptimState8bit

        return OptimState8bit.zeros((256,), signed=True, block_size=256).qmap
    raise KeyError(name)


_TABLES: dict[tuple[str, torch.device], Tensor] = {}


def table(name: str, device: torch.device) -> Tensor:
    """A constant fp32 lookup table, one copy per device: "int8", torchao's signed dynamic-tree
    code map; "int4-scale-factors", :data:`INT4_SCALE_FACTORS`; "int4-scale-midpoints",
    :data:`INT4_SCALE_MIDPOINTS`; LLOYD_MAX_INT4, :data:`LEGACY_INT4_LEVELS`."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = _table_cpu(name).to(device)
    return _TABLES[key]


# ---------------------------------------------------------------------- choosing a format


def choose_format(p: Tensor, state_dtype: str, block_size: int) -> tuple[StateFormat, str | None]:
    """The format of ``p``'s momentum, and why it falls back to bf16 (None if it does not).

    The choice depends only on the global shape and placements, so every rank agrees.
    """
    bf16 = StateFormat("bf16")
    if state_dtype == "bf16":
        return bf16, None
    numel = p.numel()
    if numel < MIN_QUANTIZED_NUMEL:
        return bf16, f"{numel} elements < {MIN_QUANTIZED_NUMEL}"
    cols = p.shape[-1]
    shards = 1
    if isinstance(p, DTensor):
        for mesh_dim, placement in enumerate(p.placements):
            dim = getattr(placement, "dim", None)
            if dim is None or dim % p.ndim != p.ndim - 1:
                continue
            if type(placement) is not Shard:
                return bf16, f"last dim sharded as {placement}"
            shards *= p.device_mesh.size(mesh_dim)
    fmt = StateFormat(state_dtype, block_size)
    if cols % (fmt.unit * shards):
        what = f"block_size {block_size}"
        if fmt.unit != block_size:
            what = f"{fmt.unit} (an int4 super-block: {INT4_SUPER_BLOCK} blocks of {what})"
        across = f" x {shards} shards of the last dim" if shards > 1 else ""
        return bf16, f"last dim {cols} not divisible by {what}{across}"
    return fmt, None


# Quantized formats a checkpoint may hold, in the order detect_format tries them.
READABLE_KINDS = ("int4", "int8", "fp8", PLAIN_FP8, ABSMAX_INT4, LLOYD_MAX_INT4)


def detect_format(p: Tensor, saved: dict[str, Tensor]) -> StateFormat | None:
    """The format of saved momentum entries for ``p`` (None: a dense buffer of any dtype).

    A quantized format matches when all its keys are there with exactly the shapes and dtypes
    of its layout for ``p``, the block size being read off its per-block tensor.
    """
    shape = tuple(p.shape)
    if CODES_KEY in saved:
        for kind in READABLE_KINDS:
            keys = FORMAT_KEYS[kind]
            if any(k not in saved for k in keys):
                continue
            blocks = saved[keys[1]].shape[-1] if saved[keys[1]].ndim else 0
            if not blocks or shape[-1] % blocks:
                continue
            fmt = StateFormat(kind, shape[-1] // blocks)
            layout = fmt.layout(shape)
            if shape[-1] % fmt.unit == 0 and all(
                (tuple(saved[k].shape), saved[k].dtype) == layout[k] for k in keys
            ):
                return fmt
        found = ", ".join(
            f"{k} {tuple(v.shape)} {v.dtype}" for k, v in saved.items() if k in STATE_KEYS
        )
        raise ValueError(f"cannot read saved momentum for a parameter of shape {shape}: {found}")
    if BUFFER_KEY in saved:
        if saved[BUFFER_KEY].dtype == torch.bfloat16:
            return StateFormat("bf16")
        return None
    raise ValueError(f"saved Muon state has none of {STATE_KEYS}: keys {sorted(saved)}")


def restore(p: Tensor, saved: dict[str, Tensor], target: StateFormat) -> dict[str, Tensor]:
    """Saved momentum entries of ``p`` as state in ``target`` format, laid out like ``p``.

    Entries already in ``target`` format are adopted as they are (moved to ``p``'s device and
    layout); others (a different dtype or block size, a legacy int4 format, or the fp32
    ``momentum_buffer`` of ``Muon`` / ``MuonForeach``) are dequantized to fp32 and requantized.
    """
    saved = {k: match_layout(p, v, k) for k, v in saved.items() if k in STATE_KEYS}
    source = detect_format(p, saved)
    if source == target:
        return {k: saved[k] for k in target.keys}
    shape = tuple(local(p).shape)
    if source is None:
        dense = local(saved[BUFFER_KEY]).float()
    else:
        dense = source.read({k: local(saved[k]) for k in source.keys}, shape)
    state = target.zeros(p)
    target.write({k: local(v) for k, v in state.items()}, dense)
    return state


# ---------------------------------------------------------------------- layouts


def key_placements(p: DTensor, key: str | None) -> tuple:
    """Placements of state tensor ``key`` of DTensor ``p``: ``p``'s own, except for fp8's
    rank-1 factors (along its rows and columns, :func:`~muon_plugin.lp_rank1.factor_placements`)."""
    return factor_placements(p, key) if key in FACTOR_KEYS else tuple(p.placements)


def like_param(
    p: Tensor, t: Tensor, global_shape: tuple[int, ...], key: str | None = None
) -> Tensor:
    """Wrap the local tensor ``t`` as a DTensor laid out like ``p``'s state tensor ``key``
    (:func:`key_placements`; ``t`` itself if ``p`` is plain)."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(
        t,
        p.device_mesh,
        key_placements(p, key),
        run_check=False,
        shape=torch.Size(global_shape),
        stride=contiguous_stride(global_shape),
    )


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def match_layout(p: Tensor, v: Any, key: str | None = None) -> Any:
    """A loaded state tensor ``key`` on ``p``'s device and in its layout for ``p``."""
    if not isinstance(v, Tensor):
        return v
    lp = local(p)
    if isinstance(p, DTensor):
        placements = key_placements(p, key)
        if isinstance(v, DTensor):
            if tuple(v.placements) != placements or v.device_mesh != p.device_mesh:
                v = v.redistribute(p.device_mesh, placements)
            lv = v.to_local()
            if lv.device != lp.device:
                v = like_param(p, lv.to(lp.device), tuple(v.shape), key)
            return v
        # A full tensor on every rank: keep this rank's shard, no communication.
        return distribute_tensor(v.to(lp.device), p.device_mesh, placements, src_data_rank=None)
    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.to(lp.device)


def state_nbytes(state: dict[str, Tensor]) -> int:
    """Bytes of this rank's momentum state tensors (local shards)."""
    return sum(
        local(v).numel() * local(v).element_size() for k, v in state.items() if k in STATE_KEYS
    )
