"""Low-precision Muon momentum: storage formats, the per-step update, and checkpoint conversion.

A parameter's momentum is stored in one of these formats (:class:`StateFormat`):

- ``bf16``: ``momentum_buffer``, a bf16 tensor shaped like the parameter.
- ``int8`` / ``fp8``: ``momentum_codes`` (uint8 / float8_e4m3fn, shaped like the parameter) and
  ``momentum_scales`` (fp32, shape ``(*param.shape[:-1], param.shape[-1] // block_size)``).
- ``int4``: ``momentum_codes`` (uint8, two 4-bit codes a byte, shape
  ``(*param.shape[:-1], param.shape[-1] // 2)``) and ``momentum_scales`` as above.

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
fp8). int4 uses torchao's 4-bit code-map primitives (``quantize_4bit_with_qmap`` /
``dequant_with_qmap``) with its own code map and scale, not ``OptimState4bit``'s (see
:data:`INT4_LEVELS`). torchao is imported only for quantized formats (the ``lp`` extra).

Why int4 does not use torchao's 4-bit first-moment format: Muon momentum is close to Gaussian
within a block (kurtosis about 4), and its quantization error is fed back every step
(``buf <- lerp(Q(buf), grad, 1 - momentum)``), so it accumulates in the momentum about
``1 / sqrt(1 - momentum**2)`` = 3x (momentum 0.95). torchao's signed dynamic-tree map with absmax
scaling spends 7 of its 16 codes on ``|x| < 0.08 * absmax`` and has steps of ``0.225 * absmax``
(about 0.7 standard deviations) where most of the mass is; it is also asymmetric (largest
negative code ``-0.8875``). Its relative error on real Muon momentum is about 15%, against 10.6%
for the Gaussian Lloyd-Max map with an RMS scale used here, and in training the loss gap shrank
accordingly (see scripts/bench_lp.py).
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
# torchao's own defaults for its low-bit Adam optimizers.
DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 128, "fp8": 256}
# Like torchao's (and bitsandbytes') optimizers: smaller tensors are not worth quantizing.
MIN_QUANTIZED_NUMEL = 4096

BUFFER_KEY = "momentum_buffer"
CODES_KEY = "momentum_codes"
SCALES_KEY = "momentum_scales"
STATE_KEYS = (BUFFER_KEY, CODES_KEY, SCALES_KEY)

# int4: the 16 reconstruction levels of the Lloyd-Max (minimum mean-squared error) quantizer for
# a unit Gaussian (J. Max, 1960), symmetric, divided by the largest so the map spans [-1, 1] as
# torchao's code maps do. A block's scale is its RMS times INT4_LEVEL_MAX, so a code ``c``
# decodes to ``INT4_LEVELS[c] * scale`` (torchao's ``dequant_with_qmap``). An all-zero block
# has scale 0 and decodes to exact zeros. Relative RMS error: 9.5% on Gaussian blocks (the best
# any 16-level scalar quantizer can do there; torchao's 4-bit dynamic-tree map: 15%).
INT4_LEVEL_MAX = 2.7326
_LLOYD_MAX_16 = (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)
INT4_LEVELS = tuple(
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
        return self.kind in QUANTIZED_DTYPES

    @property
    def keys(self) -> tuple[str, ...]:
        return (CODES_KEY, SCALES_KEY) if self.quantized else (BUFFER_KEY,)

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each state tensor for a parameter (or shard) of ``shape``."""
        if not self.quantized:
            return {BUFFER_KEY: (shape, torch.bfloat16)}
        *lead, cols = shape
        codes_dtype = torch.float8_e4m3fn if self.kind == "fp8" else torch.uint8
        codes_cols = cols // 2 if self.kind == "int4" else cols
        return {
            CODES_KEY: ((*lead, codes_cols), codes_dtype),
            SCALES_KEY: ((*lead, cols // self.block_size), torch.float32),
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
        codes, scales = state[CODES_KEY].view(-1), state[SCALES_KEY].view(-1)
        if self.kind == "int8":
            from torchao.optim.subclass_8bit import OptimState8bit

            return OptimState8bit(codes, scales, qmap(self.kind, codes.device), True)
        if self.kind == "int4":
            return Int4State(codes, scales, qmap(self.kind, codes.device))
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
    """Packed 4-bit codes, one fp32 scale a block, and the code map (all 1-D, shared storage).

    ``read`` / ``dequantize`` and ``copy_`` mirror torchao's optimizer-state tensors, so
    :class:`StateFormat` treats every quantized kind alike.
    """

    def __new__(cls, codes: Tensor, scales: Tensor, qmap: Tensor) -> Int4State:
        return super().__new__(cls, (codes, scales, qmap))

    def dequantize(self) -> Tensor:
        return int4_dequantize(*self)

    def copy_(self, x: Tensor) -> Int4State:
        int4_quantize_(*self, x)
        return self


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


def int4_dequantize(codes: Tensor, scales: Tensor, qmap: Tensor) -> Tensor:
    """fp32 values (1-D) of packed int4 codes: ``qmap[code] * scale`` (torchao's dequant)."""
    from torchao.optim.quant_utils import dequant_with_qmap

    unpacked = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    return dequant_with_qmap(unpacked, qmap, scales)


def int4_quantize_(codes: Tensor, scales: Tensor, qmap: Tensor, x: Tensor) -> None:
    """Store ``x`` (fp32, 1-D) into packed int4 ``codes`` and per-block ``scales``, in place.

    The scale of a block is its RMS times :data:`INT4_LEVEL_MAX`; each element gets the code of
    the nearest level (torchao's ``quantize_4bit_with_qmap``), and values beyond the outermost
    level (2.73 RMS) clip to it.
    """
    from torchao.optim.quant_utils import quantize_4bit_with_qmap

    blocks = x.view(scales.numel(), -1)
    scale = blocks.square().mean(-1).sqrt() * INT4_LEVEL_MAX
    normalized = blocks / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q = quantize_4bit_with_qmap(normalized.view(-1), qmap)
    codes.copy_((q[::2] << 4) | q[1::2])
    scales.copy_(scale)


def int4_update(
    codes: Tensor, scales: Tensor, qmap: Tensor, grad: Tensor, momentum: float, nesterov: bool
) -> Tensor:
    """Momentum step on int4 state (dequantize, update in fp32, requantize in place)."""
    g = grad.float()
    buf = int4_dequantize(codes, scales, qmap).lerp_(g, 1.0 - momentum)
    int4_quantize_(codes, scales, qmap, buf)
    return g.lerp(buf, momentum) if nesterov else buf


@functools.cache
def compiled_update(fn):
    """``fn`` under ``torch.compile`` (static shapes, the whole update in one graph)."""
    # torch warns once per torchao subclass about AOT-autograd cache keys; it is harmless here.
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    return torch.compile(fn, fullgraph=True, dynamic=False)


@functools.cache
def _qmap_cpu(kind: str) -> Tensor:
    if kind == "int4":
        return torch.tensor(INT4_LEVELS, dtype=torch.float32)
    # torchao builds its signed 8-bit code map in zeros(); reuse it rather than restating it.
    from torchao.optim.subclass_8bit import OptimState8bit

    return OptimState8bit.zeros((256,), signed=True, block_size=256).qmap


_QMAPS: dict[tuple[str, torch.device], Tensor] = {}


def qmap(kind: str, device: torch.device) -> Tensor:
    """The code map for ``kind``: torchao's signed dynamic-tree map for "int8",
    :data:`INT4_LEVELS` for "int4"; one copy per device."""
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
    if CODES_KEY in saved and SCALES_KEY in saved:
        codes, scales = saved[CODES_KEY], saved[SCALES_KEY]
        shape, cols = tuple(p.shape), p.shape[-1]
        blocks = scales.shape[-1] if scales.ndim else 0
        if blocks and cols % blocks == 0 and tuple(scales.shape[:-1]) == shape[:-1]:
            block_size = cols // blocks
            if codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == shape:
                return StateFormat("fp8", block_size)
            if codes.dtype == torch.uint8 and tuple(codes.shape) == shape:
                return StateFormat("int8", block_size)
            if codes.dtype == torch.uint8 and tuple(codes.shape) == (*shape[:-1], cols // 2):
                return StateFormat("int4", block_size)
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
