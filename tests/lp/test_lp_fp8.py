"""The fp8 codec (muon_plugin.lp.fp8): e4m3 codes of the residual under an fp32 absmax / 448 a
block, plus a bf16 rank-1 part ``u w^T`` laid out along the rows and columns."""

from __future__ import annotations

import pytest
import torch
from lp_support import KWARGS, groups, mlp, muon_params, rel_err, roundtrip, zero_state

from muon_plugin.lp import Fp8Codec, MuonLP
from muon_plugin.lp.keys import CODES_KEY, SCALES_KEY, U_KEY, W_KEY

pytest.importorskip("torchao")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def test_layout_keys_and_bytes_per_element():
    codec = Fp8Codec(256)
    assert codec.kind == "fp8" and codec.keys == (CODES_KEY, SCALES_KEY, U_KEY, W_KEY)
    assert codec.layout((3, 64, 512)) == {
        CODES_KEY: ((3, 64, 512), torch.float8_e4m3fn),
        SCALES_KEY: ((3, 64, 2), torch.float32),
        U_KEY: ((3, 64), torch.bfloat16),
        W_KEY: ((3, 512), torch.bfloat16),
    }
    # 1 + 4/256 + 2 bytes per row and per column.
    assert codec.bytes_per_element((1024, 4096)) == 1 + 4 / 256 + 2 * (1024 + 4096) / (1024 * 4096)


def test_round_trip_is_e4m3_of_the_block_scaled_value():
    """Encoding puts everything in the codes (``u = 0``, ``w = 1``): each element decodes to
    its e4m3 rounding under the block's absmax / 448."""
    torch.manual_seed(0)
    x = torch.randn(64, 1024) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    y, state = roundtrip(Fp8Codec(256), x)
    scale = x.view(-1, 256).abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    expected = (x.view(-1, 256) / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]
    assert torch.equal(y, expected.view_as(x))
    assert not state[U_KEY].any() and torch.all(state[W_KEY] == 1)
    # e4m3 keeps 3 mantissa bits: at most 1/16 of an element off (normal range); 2.6% measured.
    gauss = torch.randn(64, 1024)
    assert rel_err(roundtrip(Fp8Codec(256), gauss)[0], gauss) < 0.04


def test_decode_adds_the_rank1_part():
    codec = Fp8Codec(256)
    state = zero_state(codec, (8, 256))
    codec.encode_(state, torch.randn(8, 256))
    codes_only = codec.decode(state, (8, 256))
    state[U_KEY].copy_(torch.randn(8))
    state[W_KEY].copy_(torch.randn(256))
    u, w = state[U_KEY].float(), state[W_KEY].float()
    assert torch.equal(codec.decode(state, (8, 256)), codes_only + u[:, None] * w[None, :])


def test_fp8_state_layout_and_rank1_part():
    """With gradients that share a direction, u w^T carries it and the fp8 residual is much
    smaller than the momentum."""
    model = mlp()
    opt = MuonLP(groups(model), state_dtype="fp8", **KWARGS)
    mats = muon_params(opt)
    gen = torch.Generator().manual_seed(7)
    shared = [
        (torch.randn(p.shape[0], 1, generator=gen), torch.randn(1, p.shape[1], generator=gen))
        for p in mats
    ]
    for _ in range(6):
        for p, (a, b) in zip(mats, shared, strict=True):
            p.grad = 3.0 * a * b + torch.randn(p.shape, generator=gen)
        opt.step()
    for p in mats:
        state = opt.state[p]
        u, w = state[U_KEY].float(), state[W_KEY].float()
        assert u.norm().item() == pytest.approx(1.0, rel=1e-2)
        m = opt.momentum(p)
        residual = m - u[:, None] * w[None, :]
        assert residual.abs().amax() < 0.5 * m.abs().amax()
        # momentum() = decoded codes + u w^T, the momentum the next step starts from.
        codes = state[CODES_KEY].float().view(m.shape[0], -1, 256)
        decoded = (codes * state[SCALES_KEY].view(m.shape[0], -1, 1)).view(m.shape)
        assert torch.allclose(decoded + u[:, None] * w[None, :], m)
