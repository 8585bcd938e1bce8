"""Reading saved momentum (muon_plugin.lp.checkpoint): which format it is, and converting it."""

from __future__ import annotations

import pytest
import torch
from lp_support import rel_err, roundtrip, zero_state

from muon_plugin.lp import Bf16Codec, Fp8Codec, Int4Codec, Int8Codec, detect_format, restore
from muon_plugin.lp.keys import BASES_KEY, BUFFER_KEY

pytest.importorskip("torchao")


def test_detect_format_reads_every_format_and_rejects_others():
    p = torch.zeros(64, 512)
    m = torch.randn(64, 512)
    codecs = [Int4Codec(16), Int4Codec(8), Int8Codec(128), Fp8Codec(256)]
    for codec in codecs:
        assert detect_format(p, zero_state(codec, tuple(p.shape))) == codec
    assert detect_format(p, {BUFFER_KEY: m.bfloat16()}) == Bf16Codec()
    assert detect_format(p, {BUFFER_KEY: m}) is None  # Muon's fp32 buffer
    bad = roundtrip(Int4Codec(16), m)[1]
    bad[BASES_KEY] = bad[BASES_KEY].float()
    with pytest.raises(ValueError, match="cannot read saved momentum"):
        detect_format(p, bad)
    with pytest.raises(ValueError, match="saved Muon state has none of"):
        detect_format(p, {"exp_avg": m})


def test_restore_adopts_its_own_format_and_converts_others():
    p = torch.zeros(64, 512)
    m = torch.randn(64, 512)
    saved = roundtrip(Int8Codec(256), m)[1]
    adopted = restore(p, saved, Int8Codec(256))
    assert all(adopted[k] is saved[k] for k in saved)  # same device and layout: as they are
    converted = restore(p, saved, Int4Codec(16))
    assert set(converted) == set(Int4Codec.keys)
    decoded = Int8Codec(256).decode(saved, (64, 512))
    assert torch.equal(
        Int4Codec(16).decode(converted, (64, 512)), roundtrip(Int4Codec(16), decoded)[0]
    )
    from_fp32 = restore(p, {BUFFER_KEY: m}, Int8Codec(256))
    assert rel_err(Int8Codec(256).decode(from_fp32, (64, 512)), m) < 0.02
