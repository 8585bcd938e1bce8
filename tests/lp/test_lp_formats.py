"""Formats by name (muon_plugin.lp.formats): one codec per state dtype of muon_plugin.defaults,
the options checked, a fallback to bf16 that says why."""

from __future__ import annotations

import pytest
import torch

from muon_plugin.defaults import LP_STATE_DTYPES
from muon_plugin.lp import CODECS, STATE_KEYS, Bf16Codec, Int4Codec, Int8Codec, choose_format
from muon_plugin.lp.formats import DEFAULT_BLOCK_SIZES, validate_state_dtype


def test_one_codec_per_state_dtype_and_every_key_once():
    assert set(CODECS) == set(LP_STATE_DTYPES)
    assert all(CODECS[k].kind == k for k in CODECS)
    assert DEFAULT_BLOCK_SIZES == {"int8": 256, "int4": 16, "fp8": 256}
    assert set(STATE_KEYS) == {k for c in CODECS.values() for k in c.keys}
    assert len(set(STATE_KEYS)) == len(STATE_KEYS)


def test_validate_state_dtype_gives_the_block_size():
    assert validate_state_dtype("bf16", None) == 0
    assert validate_state_dtype("int8", None) == 256
    assert validate_state_dtype("int4", None) == 16
    assert validate_state_dtype("fp8", 64) == 64
    with pytest.raises(ValueError, match="unknown state_dtype 'fp32'"):
        validate_state_dtype("fp32", None)
    with pytest.raises(ValueError, match="block_size must be even"):
        validate_state_dtype("int4", 15)


def test_choose_format_falls_back_to_bf16_with_a_reason():
    assert choose_format(torch.zeros(64, 256), "int8", 256) == (Int8Codec(256), None)
    assert choose_format(torch.zeros(64, 512), "int4", 16) == (Int4Codec(16), None)
    assert choose_format(torch.zeros(64, 256), "bf16", 0) == (Bf16Codec(), None)
    codec, why = choose_format(torch.zeros(64, 100), "int8", 256)
    assert codec == Bf16Codec() and why == "last dim 100 not divisible by block_size 256"
    codec, why = choose_format(torch.zeros(8, 256), "int8", 256)
    assert codec == Bf16Codec() and why == "2048 elements < 4096"
