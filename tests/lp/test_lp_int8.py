"""The int8 codec (muon_plugin.lp.int8): torchao's signed dynamic-tree codes, an fp32 absmax a
block. Round trips against a brute-force oracle: each element decodes to the nearest level of
the code map times its block's absmax."""

from __future__ import annotations

import pytest
import torch
from lp_support import rel_err, roundtrip

from muon_plugin.lp import Int8Codec
from muon_plugin.lp.keys import CODES_KEY, SCALES_KEY

pytest.importorskip("torchao")


def qmap() -> torch.Tensor:
    from torchao.optim.quant_utils import create_dynamic_map

    return torch.tensor(create_dynamic_map(signed=True), dtype=torch.float32)


def test_layout_keys_and_bytes_per_element():
    codec = Int8Codec(128)
    assert codec.kind == "int8" and codec.keys == (CODES_KEY, SCALES_KEY)
    assert codec.needs_torchao and Int8Codec.default_block_size == 256
    assert codec.layout((3, 64, 512)) == {
        CODES_KEY: ((3, 64, 512), torch.uint8),
        SCALES_KEY: ((3, 64, 4), torch.float32),
    }
    assert Int8Codec(256).bytes_per_element((64, 512)) == 1 + 4 / 256


@pytest.mark.parametrize("block_size", [64, 256])
def test_round_trip_is_nearest_level_of_block_absmax(block_size):
    torch.manual_seed(0)
    x = torch.randn(64, 1024) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    x[5, :block_size] = 0.0  # an all-zero block decodes to zeros
    y, state = roundtrip(Int8Codec(block_size), x)
    blocks = x.view(-1, block_size)
    absmax = blocks.abs().amax(-1)
    assert torch.equal(state[SCALES_KEY].view(-1), absmax.clamp_min(1e-12))
    levels = qmap()
    scale = state[SCALES_KEY].view(-1, 1)
    normalized = blocks / scale
    gap = (normalized.unsqueeze(-1) - levels).abs().amin(-1)
    chosen = (normalized - y.view(-1, block_size) / scale).abs()
    assert torch.all(chosen <= gap + 1e-6)
    assert torch.equal(y[5, :block_size], torch.zeros(block_size))
    # One-shot error on Gaussian blocks of 256: 1.1% measured.
    gauss = torch.randn(64, 1024)
    assert rel_err(roundtrip(Int8Codec(256), gauss)[0], gauss) < 0.02
