"""Loading saved momentum into a MuonLP format: reading which format it is, converting it.

``load_state_dict`` hands each Muon parameter's saved momentum entries here. Entries already in
the parameter's format are adopted as they are; any other format (another ``state_dtype`` or
block size, or the fp32 ``momentum_buffer`` of ``Muon`` / ``MuonForeach``) is decoded to fp32 and
encoded into it. Either way the entries end up on the parameter's device and in its layout.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.lp.codec import MomentumCodec
from muon_plugin.lp.formats import CODECS, STATE_KEYS
from muon_plugin.lp.keys import BUFFER_KEY, CODES_KEY
from muon_plugin.parameters import local
from muon_plugin.state_layout import match_layout

QUANTIZED_CODECS = tuple(c for c in CODECS.values() if c.quantized)
"""The formats with codes, in the order :func:`detect_format` tries them."""


def detect_format(p: Tensor, saved: Mapping[str, Tensor]) -> MomentumCodec | None:
    """The format of saved momentum entries for ``p`` (None: a dense buffer of another dtype).

    A quantized format matches when all its keys are there with exactly the shapes and dtypes
    of its layout for ``p`` (global shapes), the block size being read off its per-block tensor.
    """
    shape = tuple(p.shape)
    if CODES_KEY in saved:
        for cls in QUANTIZED_CODECS:
            codec = cls.from_saved(shape, saved)
            if codec is not None:
                return codec
        found = ", ".join(
            f"{k} {tuple(v.shape)} {v.dtype}" for k, v in saved.items() if k in STATE_KEYS
        )
        raise ValueError(f"cannot read saved momentum for a parameter of shape {shape}: {found}")
    if BUFFER_KEY in saved:
        return CODECS["bf16"].from_saved(shape, saved)
    raise ValueError(f"saved Muon state has none of {STATE_KEYS}: keys {sorted(saved)}")


def restore(p: Tensor, saved: Mapping[str, Tensor], target: MomentumCodec) -> dict[str, Tensor]:
    """Saved momentum entries of ``p`` as state in ``target`` format, laid out like ``p``."""
    saved = {k: v for k, v in saved.items() if k in STATE_KEYS}
    source = detect_format(p, saved)
    keys = (BUFFER_KEY,) if source is None else source.keys

    def placements(key: str) -> tuple | None:
        if source is None or not isinstance(p, DTensor):
            return None
        return source.placements(p, key)

    laid_out = {k: match_layout(p, saved[k], placements(k)) for k in keys}
    if source == target:
        return laid_out
    shape = tuple(local(p).shape)
    if source is None:
        dense = local(laid_out[BUFFER_KEY]).float()
    else:
        dense = source.decode({k: local(v) for k, v in laid_out.items()}, shape)
    state = target.zeros(p)
    target.encode_({k: local(v) for k, v in state.items()}, dense)
    return state
