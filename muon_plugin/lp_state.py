"""Low-precision Muon momentum: storage formats, the per-step update, and checkpoint conversion.

A parameter's momentum is stored in one of these formats (:class:`StateFormat`):

- ``bf16``: ``momentum_buffer``, a bf16 tensor shaped like the parameter.
- ``int8`` / ``fp8``: ``momentum_codes`` (uint8 / float8_e4m3fn, shaped like the parameter) and
  ``momentum_scales`` (fp32, shape ``(*param.shape[:-1], param.shape[-1] // block_size)``).
- ``int4``: ``momentum_codes`` (uint8, two 4-bit codes a byte, shape
  ``(*param.shape[:-1], param.shape[-1] // 2)``) and ``momentum_scales_bf16`` (bf16, one a
  block, shape as for ``momentum_scales``): 0.5 + 2 / 32 = 0.5625 bytes per element at the
  default block size 32.

Quantization blocks are ``block_size`` consecutive elements of one row (along the last dim),
never crossing a row. The codes and scales are plain tensors, or DTensors with exactly the
parameter's mesh and placements, so:

- the optimizer state is plain tensors: ``state_dict()``, ``torch.save``, ``copy.deepcopy`` and
  ``torch.distributed.checkpoint`` (DCP) handle it like any other optimizer state;
- a DCP checkpoint reshards like the parameter: any layout that splits rows at block boundaries
  (every sharding of the leading dims, e.g. FSDP2 / HSDP / EP / colwise TP, and last-dim sharding
  into multiples of ``block_size``) owns whole blocks with their scales, so saving on one layout
  and loading on another moves codes and scales and never re-blocks.

The math runs through torchao: int8 and fp8 use its low-bit optimizer-state tensor types (each
step wraps the local codes and scales, no copy, in ``OptimState8bit`` / ``OptimStateFp8``,
dequantizes with their ``dequantize()``, updates the momentum in fp32 and requantizes in place
with their ``copy_``: blockwise absmax scaling, the signed dynamic-tree map for int8, e4m3 for
fp8). int4 is plain torch arithmetic (see :data:`INT4_LEVELS`), not torchao's
``OptimState4bit``. torchao is imported only for int8 and fp8 (the ``lp`` extra).

The int4 format: each block of 32 is split into 16 equal cells spanning
``[-absmax, absmax]`` (``absmax`` rounded up to bf16 and stored), and each element is stored as
the centre of its cell, ``(code - 7.5) / 8 * absmax`` (a uniform mid-rise quantizer, round to
nearest). The two outermost centres are ``+-15/16 * absmax``, so the largest element of a block
is stored up to 1/16 smaller than it is. How it was chosen (scripts/bench_lp.py's ``mlp`` task,
the sensitive one, CPU ``--quick``, mean of 2-3 data seeds, final loss against fp32-state Muon;
full table in docs/performance.md):

- the previous format (Gaussian Lloyd-Max map, per-block fp32 RMS scale, block 128; the
  lowest one-shot error of any 16-level scalar code on Gaussian blocks, 9.5%) was +8.8%, and
  the same map with absmax scales, stochastic rounding or blocks of 32 / 16 +9% to +17%:
  one-shot error does not decide, since the momentum is requantized every step
  (``buf <- lerp(Q(buf), grad, 1 - momentum)``) and its error compounds;
- a uniform map whose outermost levels are ``+-absmax`` (``linspace(-1, 1, 16)``), block 32,
  bf16 absmax: +11.7% with round to nearest or stochastic rounding;
- this mid-rise map, block 32, bf16 absmax, round to nearest: +1.0 to +1.4% (block 64: +3.5
  to +4.0%; block 128: +5.7%); stochastic rounding +2.5%, a low-discrepancy temporal dither
  +0.6% (within noise, and it needs a step counter and global element indices).

The difference between the last two is the top cell: the largest element of each block is
stored at 15/16 of itself, which damps the largest momentum entries a little every step. That
damping alone (fp32 momentum clipped to 15/16 of each block's absmax, no rounding) lowers the
``mlp`` loss by 3.2%, so about 3 of the ~4.5 points the int4 rounding costs there are offset by
the damping rather than removed: the format slightly changes the algorithm, it is not only a
coarser copy of fp32 momentum.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

STATE_DTYPES = ("bf16", "int8", "int4", "fp8")
QUANTIZED_DTYPES = ("int8", "int4", "fp8")
# torchao's own defaults for its low-bit Adam optimizers (int8, fp8); int4 measured (above).
DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 32, "fp8": 256}
# Like torchao's (and bitsandbytes') optimizers: smaller tensors are not worth quantizing.
MIN_QUANTIZED_NUMEL = 4096

BUFFER_KEY = "momentum_buffer"
CODES_KEY = "momentum_codes"
SCALES_KEY = "momentum_scales"  # fp32 scales of int8 / fp8 (and of the legacy int4 format)
INT4_SCALES_KEY = "momentum_scales_bf16"  # bf16 absmax of each int4 block
STATE_KEYS = (BUFFER_KEY, CODES_KEY, SCALES_KEY, INT4_SCALES_KEY)
# The int4 format of earlier versions (Lloyd-Max map, fp32 RMS scales under SCALES_KEY): still
# read by load_state_dict (converted to the current format), never written.
LEGACY_INT4 = "int4-lloyd-max"

# int4: code ``c`` decodes to ``INT4_LEVELS[c] * absmax`` = ``(c - 7.5) / 8 * absmax``, the
# centre of cell ``c`` of 16 equal cells spanning [-absmax, absmax] (a uniform mid-rise map; no
# level is 0 or +-absmax). ``absmax`` is the block's largest magnitude rounded up to bf16. An
# all-zero block has absmax 0 and decodes to exact zeros.
INT4_LEVELS = tuple((2 * c - 15) / 16 for c in range(16))
# The legacy int4 format's map (read only): the 16 levels of the Lloyd-Max quantizer for a unit
# Gaussian (J. Max, 1960) over INT4_LEVEL_MAX; its fp32 scale was the block RMS * INT4_LEVEL_MAX.
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
    """How one parameter's momentum is stored: ``kind`` in STATE_DTYPES, and the block size."""

    kind: str
    block_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.kind in QUANTIZED_DTYPES or self.kind == LEGACY_INT4

    @property
    def scales_key(self) -> str:
        return INT4_SCALES_KEY if self.kind == "int4" else SCALES_KEY

    @property
    def keys(self) -> tuple[str, ...]:
        return (CODES_KEY, self.scales_key) if self.quantized else (BUFFER_KEY,)

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each state tensor for a parameter (or shard) of ``shape``."""
        if not self.quantized:
            return {BUFFER_KEY: (shape, torch.bfloat16)}
        *lead, cols = shape
        codes_dtype = torch.float8_e4m3fn if self.kind == "fp8" else torch.uint8
        codes_cols = cols // 2 if self.kind in ("int4", LEGACY_INT4) else cols
        scales_dtype = torch.bfloat16 if self.kind == "int4" else torch.float32
        return {
            CODES_KEY: ((*lead, codes_cols), codes_dtype),
            self.scales_key: ((*lead, cols // self.block_size), scales_dtype),
        }

    def zeros(self, p: Tensor) -> dict[str, Tensor]:
        """Zero momentum for ``p``: plain tensors, or DTensors laid out like ``p``."""
        lp = local(p)
        local_layout = self.layout(tuple(lp.shape))
        global_layout = self.layout(tuple(p.shape))
        out = {}
        for key, (shape, dtype) in local_layout.items():
            t = torch.zeros(shape, dtype=dtype, device=lp.device)
            out[key] = like_param(p, t, global_layout[key][0])
        return out

    # The methods below take the LOCAL state tensors ({key: local tensor}).

    def view(self, state: dict[str, Tensor]) -> Tensor | Int4State:
        """The local state as a torchao optimizer-state tensor, or an :class:`Int4State` (1-D,
        sharing storage)."""
        codes, scales = state[CODES_KEY].view(-1), state[self.scales_key].view(-1)
        if self.kind == "int8":
            from torchao.optim.subclass_8bit import OptimState8bit

            return OptimState8bit(codes, scales, qmap(self.kind, codes.device), True)
        if self.kind == "int4":
            return Int4State(codes, scales)
        if self.kind == LEGACY_INT4:
            return LegacyInt4State(codes, scales, qmap(self.kind, codes.device))
        from torchao.optim.subclass_fp8 import OptimStateFp8

        return OptimStateFp8(codes, scales)

    def read(self, state: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """The local momentum in fp32, shaped ``shape`` (the local parameter shape)."""
        if not self.quantized:
            return state[BUFFER_KEY].float()
        if state[CODES_KEY].numel() == 0:
            return torch.zeros(shape, dtype=torch.float32, device=state[CODES_KEY].device)
        return self.view(state).dequantize().view(shape)

    def write(self, state: dict[str, Tensor], dense: Tensor) -> None:
        """Store ``dense`` (fp32, local parameter shape) into the local state."""
        if self.kind == LEGACY_INT4:
            raise ValueError(f"the {LEGACY_INT4} int4 format is read only (checkpoints)")
        if not self.quantized:
            state[BUFFER_KEY].copy_(dense)
        elif dense.numel():
            self.view(state).copy_(dense.reshape(-1))

    def update(
        self,
        state: dict[str, Tensor],
        grad: Tensor,
        momentum: float,
        nesterov: bool,
        compiled: bool = False,
    ) -> Tensor:
        """Muon's momentum step on the local state; returns the fp32 direction (grad's shape).

        ``buf <- lerp(buf, grad, 1 - momentum)`` in fp32 on the dequantized state, requantized
        in place; the direction is the Nesterov look-ahead ``lerp(grad, buf, momentum)`` or the
        fp32 ``buf`` itself, so quantization error enters only through the stored state.
        """
        if grad.numel() == 0:
            return torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        if self.kind == LEGACY_INT4:
            raise ValueError(f"the {LEGACY_INT4} int4 format is read only (checkpoints)")
        if self.kind == "int4":
            fn, held = int4_update, tuple(self.view(state))
        elif self.quantized:
            fn, held = quantized_update, (self.view(state),)
        else:
            fn, held = dense_update, (state[BUFFER_KEY].view(-1),)
        if compiled:
            # One graph per distinct size (static shapes: inductor's CPU codegen can stall on
            # the symbolic block indexing of dynamic ones); a model has few distinct sizes.
            from torch._dynamo.utils import disable_cache_limit

            with disable_cache_limit():
                direction = compiled_update(fn)(*held, grad.reshape(-1), momentum, nesterov)
        else:
            direction = fn(*held, grad.reshape(-1), momentum, nesterov)
        return direction.view(grad.shape)


class Int4State(tuple):
    """Packed 4-bit codes and one bf16 absmax a block (both 1-D, shared storage).

    ``dequantize`` and ``copy_`` mirror torchao's optimizer-state tensors, so
    :class:`StateFormat` treats every quantized kind alike.
    """

    def __new__(cls, codes: Tensor, scales: Tensor) -> Int4State:
        return super().__new__(cls, (codes, scales))

    def dequantize(self) -> Tensor:
        return int4_dequantize(*self)

    def copy_(self, x: Tensor) -> Int4State:
        int4_quantize_(*self, x)
        return self


class LegacyInt4State(tuple):
    """The legacy int4 format (read only): packed codes, fp32 scales, the Lloyd-Max map."""

    def __new__(cls, codes: Tensor, scales: Tensor, qmap: Tensor) -> LegacyInt4State:
        return super().__new__(cls, (codes, scales, qmap))

    def dequantize(self) -> Tensor:
        codes, scales, qmap = self  # qmap[code] * scale, as torchao's dequant_with_qmap
        values = qmap[unpack_int4(codes).long()].view(scales.numel(), -1)
        return (values * scales.view(-1, 1)).view(-1)


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


def unpack_int4(codes: Tensor) -> Tensor:
    """The 4-bit codes (uint8, 1-D, twice as long) of packed bytes, high nibble first."""
    return torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)


def int4_dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """fp32 values (1-D) of packed int4 codes: ``INT4_LEVELS[code] * absmax``."""
    centred = unpack_int4(codes).float().sub_(7.5).view(scales.numel(), -1)
    return centred.mul_(scales.float().mul(0.125).unsqueeze(-1)).view(-1)


def int4_quantize_(codes: Tensor, scales: Tensor, x: Tensor) -> None:
    """Store ``x`` (fp32, 1-D) into packed int4 ``codes`` and per-block bf16 ``scales``.

    A block's scale is its absmax rounded up to bf16 (the smallest bf16 >= absmax); each element
    gets the code of its cell, ``floor(8 * x / scale) + 8`` clamped to [0, 15], i.e. the nearest
    level of :data:`INT4_LEVELS` times the scale (elements beyond ``15/16 * scale`` take the
    outermost). The rounding is done on the fp32 bits, so compiled code (where inductor may drop
    an fp32 -> bf16 -> fp32 round trip) quantizes exactly like eager.
    """
    blocks = x.view(scales.numel(), -1)
    absmax = blocks.abs().amax(-1)
    scale = ((absmax.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)
    inv = scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q = blocks.div(inv).mul_(8.0).floor_().add_(8.0).clamp_(0.0, 15.0).to(torch.uint8).view(-1)
    codes.copy_((q[::2] << 4) | q[1::2])
    scales.copy_(scale)  # exact: scale is a bf16 value


def int4_update(
    codes: Tensor, scales: Tensor, grad: Tensor, momentum: float, nesterov: bool
) -> Tensor:
    """Momentum step on int4 state (dequantize, update in fp32, requantize in place)."""
    g = grad.float()
    buf = int4_dequantize(codes, scales).lerp_(g, 1.0 - momentum)
    int4_quantize_(codes, scales, buf)
    return g.lerp(buf, momentum) if nesterov else buf


@functools.cache
def compiled_update(fn):
    """``fn`` under ``torch.compile`` (static shapes, the whole update in one graph)."""
    # torch warns once per torchao subclass about AOT-autograd cache keys; it is harmless here.
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    return torch.compile(fn, fullgraph=True, dynamic=False)


@functools.cache
def _qmap_cpu(kind: str) -> Tensor:
    if kind == LEGACY_INT4:
        return torch.tensor(LEGACY_INT4_LEVELS, dtype=torch.float32)
    # torchao builds its signed 8-bit code map in zeros(); reuse it rather than restating it.
    from torchao.optim.subclass_8bit import OptimState8bit

    return OptimState8bit.zeros((256,), signed=True, block_size=256).qmap


_QMAPS: dict[tuple[str, torch.device], Tensor] = {}


def qmap(kind: str, device: torch.device) -> Tensor:
    """The code map for ``kind``: torchao's signed dynamic-tree map for "int8",
    :data:`LEGACY_INT4_LEVELS` for the legacy int4 format; one copy per device."""
    key = (kind, device)
    if key not in _QMAPS:
        _QMAPS[key] = _qmap_cpu(kind).to(device)
    return _QMAPS[key]


# ---------------------------------------------------------------------- choosing a format


def choose_format(p: Tensor, state_dtype: str, block_size: int) -> tuple[StateFormat, str | None]:
    """The format of ``p``'s momentum, and why it falls back to bf16 (None if it does not).

    The choice depends only on the global shape and placements, so every rank agrees.
    """
    if state_dtype == "bf16":
        return StateFormat("bf16"), None
    bf16 = StateFormat("bf16")
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
    if cols % (block_size * shards):
        across = f" x {shards} shards of the last dim" if shards > 1 else ""
        return bf16, f"last dim {cols} not divisible by block_size {block_size}{across}"
    return StateFormat(state_dtype, block_size), None


def detect_format(p: Tensor, saved: dict[str, Tensor]) -> StateFormat | None:
    """The format of saved momentum entries for ``p`` (None: a dense buffer of any dtype)."""
    scales_key = next((k for k in (INT4_SCALES_KEY, SCALES_KEY) if k in saved), None)
    if CODES_KEY in saved and scales_key is not None:
        codes, scales = saved[CODES_KEY], saved[scales_key]
        shape, cols = tuple(p.shape), p.shape[-1]
        blocks = scales.shape[-1] if scales.ndim else 0
        if blocks and cols % blocks == 0 and tuple(scales.shape[:-1]) == shape[:-1]:
            block_size = cols // blocks
            packed = codes.dtype == torch.uint8 and tuple(codes.shape) == (*shape[:-1], cols // 2)
            if scales_key == INT4_SCALES_KEY:
                if packed and scales.dtype == torch.bfloat16:
                    return StateFormat("int4", block_size)
            elif codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == shape:
                return StateFormat("fp8", block_size)
            elif codes.dtype == torch.uint8 and tuple(codes.shape) == shape:
                return StateFormat("int8", block_size)
            elif packed:
                # int4 saved by an earlier version (Lloyd-Max map, fp32 RMS scales).
                return StateFormat(LEGACY_INT4, block_size)
        raise ValueError(
            f"cannot read saved momentum for a parameter of shape {shape}: codes "
            f"{tuple(codes.shape)} {codes.dtype}, scales {tuple(scales.shape)} {scales.dtype}"
        )
    if BUFFER_KEY in saved:
        if saved[BUFFER_KEY].dtype == torch.bfloat16:
            return StateFormat("bf16")
        return None
    raise ValueError(f"saved Muon state has none of {STATE_KEYS}: keys {sorted(saved)}")


def restore(p: Tensor, saved: dict[str, Tensor], target: StateFormat) -> dict[str, Tensor]:
    """Saved momentum entries of ``p`` as state in ``target`` format, laid out like ``p``.

    Entries already in ``target`` format are adopted as they are (moved to ``p``'s device and
    layout); others (a different dtype or block size, or the fp32 ``momentum_buffer`` of
    ``Muon`` / ``MuonForeach``) are dequantized to fp32 and requantized.
    """
    saved = {k: match_layout(p, v) for k, v in saved.items() if k in STATE_KEYS}
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


def like_param(p: Tensor, t: Tensor, global_shape: tuple[int, ...]) -> Tensor:
    """Wrap the local tensor ``t`` as a DTensor laid out like ``p`` (``t`` itself if plain)."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(
        t,
        p.device_mesh,
        p.placements,
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


def match_layout(p: Tensor, v: Any) -> Any:
    """A loaded state tensor on ``p``'s device and in ``p``'s kind of layout."""
    if not isinstance(v, Tensor):
        return v
    lp = local(p)
    if isinstance(p, DTensor):
        if isinstance(v, DTensor):
            if v.placements != p.placements or v.device_mesh != p.device_mesh:
                v = v.redistribute(p.device_mesh, p.placements)
            lv = v.to_local()
            if lv.device != lp.device:
                v = like_param(p, lv.to(lp.device), tuple(v.shape))
            return v
        # A full tensor on every rank: keep this rank's shard, no communication.
        return distribute_tensor(v.to(lp.device), p.device_mesh, p.placements, src_data_rank=None)
    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.to(lp.device)


def state_nbytes(state: dict[str, Tensor]) -> int:
    """Bytes of this rank's momentum state tensors (local shards)."""
    return sum(
        local(v).numel() * local(v).element_size() for k, v in state.items() if k in STATE_KEYS
    )
