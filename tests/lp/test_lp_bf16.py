"""The bf16 codec (muon_plugin.lp.bf16): one bf16 buffer, rounded to nearest, never a fallback."""

from __future__ import annotations

import torch
from lp_support import roundtrip

from muon_plugin.lp import Bf16Codec
from muon_plugin.lp.keys import BUFFER_KEY


def test_layout_keys_and_bytes_per_element():
    codec = Bf16Codec()
    assert codec.kind == "bf16" and codec.keys == (BUFFER_KEY,) and not codec.quantized
    assert codec.layout((3, 64, 100)) == {BUFFER_KEY: ((3, 64, 100), torch.bfloat16)}
    assert codec.bytes_per_element((64, 100)) == 2.0
    assert codec.unit == 1


def test_round_trip_is_bf16_rounding():
    x = torch.randn(64, 100) * torch.logspace(-20, 20, 100)
    y, state = roundtrip(Bf16Codec(), x)
    assert torch.equal(y, x.to(torch.bfloat16).float())
    assert state[BUFFER_KEY].dtype == torch.bfloat16


def test_takes_every_tensor():
    """bf16 is the fallback: no shape is refused."""
    for shape in [(1, 1), (8, 3), (64, 100), (2, 3, 5)]:
        assert Bf16Codec().fallback_reason(torch.zeros(shape)) is None
