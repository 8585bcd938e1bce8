"""The momentum formats by name: choosing one for a parameter, checking the options, torchao.

``state_dtype`` names a codec class (:data:`CODECS`); :func:`choose_format` gives a parameter
that class at the optimizer's block size, or bf16 where the parameter cannot be blocked.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from muon_plugin.defaults import LP_STATE_DTYPES
from muon_plugin.errors import SettingError
from muon_plugin.lp.bf16 import Bf16Codec
from muon_plugin.lp.codec import MomentumCodec
from muon_plugin.lp.fp8 import Fp8Codec
from muon_plugin.lp.int4 import Int4Codec
from muon_plugin.lp.int8 import Int8Codec
from muon_plugin.parameters import local

CODECS: dict[str, type[MomentumCodec]] = {
    c.kind: c for c in (Bf16Codec, Int8Codec, Int4Codec, Fp8Codec)
}
"""Every format, by ``state_dtype``."""
DEFAULT_BLOCK_SIZES = {k: c.default_block_size for k, c in CODECS.items() if c.quantized}
"""torchao's own defaults for its low-bit optimizers (int8, fp8); int4 measured."""
STATE_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for c in CODECS.values() for k in c.keys))
"""Every key any format stores: the Muon momentum entries of a MuonLP state dict."""
LP_INSTALL_HINT = "pip install 'muon_plugin[lp]'"


def codec_for(kind: str, block_size: int = 0) -> MomentumCodec:
    """The codec of format ``kind`` (a ``state_dtype``) at ``block_size`` (ignored for bf16)."""
    cls = CODECS[kind]
    return cls(block_size) if cls.quantized else cls()


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
    if state_dtype not in LP_STATE_DTYPES:
        raise SettingError(
            "state_dtype", f"unknown state_dtype {state_dtype!r}; expected one of {LP_STATE_DTYPES}"
        )
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0
    ):
        raise SettingError(
            "block_size", f"block_size must be a positive integer or None, got {block_size!r}"
        )
    cls = CODECS[state_dtype]
    if not cls.quantized:
        return 0  # unused: no blocks
    size = cls.default_block_size if block_size is None else block_size
    cls.check_block_size(size)
    return size


def choose_format(p: Tensor, state_dtype: str, block_size: int) -> tuple[MomentumCodec, str | None]:
    """The format of ``p``'s momentum, and why it falls back to bf16 (None if it does not).

    The choice depends only on the global shape and placements, so every rank agrees.
    """
    codec = codec_for(state_dtype, block_size)
    why = codec.fallback_reason(p)
    return (Bf16Codec(), why) if why is not None else (codec, None)


def state_nbytes(state: Mapping[str, Tensor]) -> int:
    """Bytes of this rank's momentum state tensors (local shards)."""
    return sum(
        local(v).numel() * local(v).element_size() for k, v in state.items() if k in STATE_KEYS
    )
