"""MuonLP: ``MuonForeach`` with Muon momentum stored in bf16, int8, int4 or fp8.

Layers, lowest first:

- :mod:`~muon_plugin.lp.keys`: the state keys checkpoints store;
- :mod:`~muon_plugin.lp.runtime`: eager or compiled update functions and their constant
  tables (the DTensor layout of state tensors is :mod:`muon_plugin.state_layout`'s);
- :mod:`~muon_plugin.lp.codec`: the interface of a format (:class:`MomentumCodec`);
- one module per format: :mod:`~muon_plugin.lp.bf16`, :mod:`~muon_plugin.lp.int8`,
  :mod:`~muon_plugin.lp.int4`, :mod:`~muon_plugin.lp.fp8` (with :mod:`~muon_plugin.lp.rank1`,
  its rank-1 power step);
- :mod:`~muon_plugin.lp.formats`: formats by ``state_dtype``, the choice per parameter;
- :mod:`~muon_plugin.lp.checkpoint`: loading saved momentum of any format;
- :mod:`~muon_plugin.lp.momentum`: stage 1 of a step, batched by shape;
- :mod:`~muon_plugin.lp.optimizer`: the :class:`MuonLP` optimizer.

int8 and fp8 need torchao (the ``lp`` extra), imported only when they run.
"""

from muon_plugin.lp.bf16 import Bf16Codec
from muon_plugin.lp.checkpoint import detect_format, restore
from muon_plugin.lp.codec import MomentumCodec
from muon_plugin.lp.formats import (
    CODECS,
    STATE_KEYS,
    choose_format,
    codec_for,
    require_torchao,
    state_nbytes,
    validate_state_dtype,
)
from muon_plugin.lp.fp8 import Fp8Codec
from muon_plugin.lp.int4 import Int4Codec
from muon_plugin.lp.int8 import Int8Codec
from muon_plugin.lp.momentum import QUANTIZED, QuantizedMomentum
from muon_plugin.lp.optimizer import MuonLP

__all__ = [
    "CODECS",
    "QUANTIZED",
    "STATE_KEYS",
    "Bf16Codec",
    "Fp8Codec",
    "Int4Codec",
    "Int8Codec",
    "MomentumCodec",
    "MuonLP",
    "QuantizedMomentum",
    "choose_format",
    "codec_for",
    "detect_format",
    "require_torchao",
    "restore",
    "state_nbytes",
    "validate_state_dtype",
]
