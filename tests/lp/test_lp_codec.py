"""The codec interface (muon_plugin.lp.codec), for every format: zero state, bytes from the
layout, detection of its own saved state, and the update against its definition (decode, fp32
lerp, encode)."""

from __future__ import annotations

import pytest
import torch
from lp_support import zero_state

from muon_plugin.lp import CODECS, MomentumCodec, codec_for

pytest.importorskip("torchao")

CODEC_CASES = [("bf16", 0), ("int8", 256), ("int8", 64), ("int4", 16), ("int4", 8), ("fp8", 256)]
SHAPE = (64, 512)


def codec_of(case) -> MomentumCodec:
    return codec_for(*case)


def state_of(codec: MomentumCodec, x: torch.Tensor) -> dict[str, torch.Tensor]:
    state = zero_state(codec, tuple(x.shape))
    codec.encode_(state, x)
    return state


@pytest.mark.parametrize("case", CODEC_CASES, ids=str)
def test_zeros_follow_the_layout_and_decode_to_zero(case):
    codec = codec_of(case)
    p = torch.zeros(SHAPE)
    state = codec.zeros(p)
    layout = codec.layout(SHAPE)
    assert tuple(state) == codec.keys == tuple(layout)
    for key, value in state.items():
        assert (tuple(value.shape), value.dtype) == layout[key], key
    assert codec.nbytes(SHAPE) == sum(v.numel() * v.element_size() for v in state.values())
    assert torch.equal(codec.decode(state, SHAPE), torch.zeros(SHAPE))


@pytest.mark.parametrize("case", CODEC_CASES, ids=str)
def test_from_saved_reads_its_own_state_and_block_size(case):
    codec = codec_of(case)
    state = state_of(codec, torch.randn(SHAPE))
    assert type(codec).from_saved(SHAPE, state) == codec
    others = [c for c in CODECS.values() if c is not type(codec)]
    assert all(c.from_saved(SHAPE, state) is None for c in others)


@pytest.mark.parametrize("case", CODEC_CASES, ids=str)
@pytest.mark.parametrize("nesterov", [True, False])
def test_update_is_lerp_on_the_decoded_state(case, nesterov):
    """``buf = lerp(decode(state), grad, 1 - momentum)`` in fp32, stored; the direction is
    ``lerp(grad, buf, momentum)`` (Nesterov) or ``buf``. fp8 also moves its rank-1 part, so its
    stored momentum is ``buf`` up to fp8 rounding of the residual."""
    codec = codec_of(case)
    gen = torch.Generator().manual_seed(0)
    state = state_of(codec, torch.randn(SHAPE, generator=gen))
    grad = torch.randn(SHAPE, generator=gen)
    buf = codec.decode(state, SHAPE).lerp(grad, 0.05)
    direction = codec.update_(state, grad, 0.95, nesterov)
    assert torch.equal(direction, grad.lerp(buf, 0.95) if nesterov else buf)
    if codec.kind == "fp8":
        stored = codec.decode(state, SHAPE)
        assert ((stored - buf).norm() / buf.norm()).item() < 0.04
    else:
        expected = state_of(codec, buf)
        for key in codec.keys:
            assert torch.equal(state[key], expected[key]), key


@pytest.mark.parametrize("case", CODEC_CASES, ids=str)
def test_empty_shard_updates_to_zeros(case):
    codec = codec_of(case)
    state = zero_state(codec, (0, 512))
    direction = codec.update_(state, torch.zeros(0, 512), 0.95, True)
    assert direction.shape == (0, 512) and direction.dtype == torch.float32
    assert codec.decode(state, (0, 512)).shape == (0, 512)
