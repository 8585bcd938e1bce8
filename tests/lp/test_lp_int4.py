"""The int4 codec (muon_plugin.lp.int4): layout, bytes, the mid-rise map, the log-scale codes.

Round trips against brute-force and fp64 oracles: every element is the nearest of the 16
levels of its block's decoded scale, every scale code the nearest in the log domain (exactly
the number of fp32 midpoints above the block's absmax), and compiled code requantizes like
eager, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from lp_support import bf16_up, rel_err, roundtrip

from muon_plugin.lp import Int4Codec
from muon_plugin.lp.int4 import (
    INT4_LEVELS,
    INT4_SCALE_MIDPOINTS,
    int4_dequantize,
    int4_quantize_,
)
from muon_plugin.lp.keys import BASES_KEY, CODES_KEY, SCALE_CODES_KEY
from muon_plugin.lp.runtime import compiled_update


def int4_roundtrip(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, dict]:
    """(dequantized x, the int4 state tensors) through MuonLP's int4 state format."""
    return roundtrip(Int4Codec(block_size), x)


def test_layout_keys_and_bytes_per_element():
    codec = Int4Codec(32)
    assert codec.kind == "int4" and codec.keys == (CODES_KEY, SCALE_CODES_KEY, BASES_KEY)
    assert codec.layout((3, 64, 1024)) == {
        CODES_KEY: ((3, 64, 512), torch.uint8),
        SCALE_CODES_KEY: ((3, 64, 32), torch.uint8),
        BASES_KEY: ((3, 64, 2), torch.bfloat16),  # a super-block: 16 blocks of 32
    }
    # 0.5 + 1/16 + 2/256 at the default block of 16 (a super-block of 256 elements).
    assert Int4Codec(16).bytes_per_element((64, 512)) == 0.5 + 1 / 16 + 2 / 256
    assert Int4Codec(16).unit == 256 and Int4Codec.default_block_size == 16
    with pytest.raises(ValueError, match="block_size must be even"):
        Int4Codec.check_block_size(127)


def test_fallback_reason_names_the_super_block():
    assert Int4Codec(16).fallback_reason(torch.zeros(64, 512)) is None
    reason = Int4Codec(16).fallback_reason(torch.zeros(64, 272))
    assert (
        reason
        == "last dim 272 not divisible by 256 (an int4 super-block: 16 blocks of block_size 16)"
    )
    assert Int4Codec(16).fallback_reason(torch.zeros(8, 256)) == "2048 elements < 4096"


# The decoded scale of code k, 2**(-k/32) of the base (rounded to fp32); 255: an all-zero block.
SCALE_FACTORS = torch.tensor([2.0 ** (-k / 32) for k in range(255)] + [0.0])


def graded_blocks(rows: int, cols: int, block_size: int, octaves: float, seed: int = 0):
    """Gaussian blocks, each scaled by 2**-u with u uniform in [0, octaves): block absmaxes
    spread over the whole range of the scale codes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols // block_size, block_size, generator=gen)
    u = torch.rand(rows, cols // block_size, 1, generator=gen) * octaves
    return (x * torch.exp2(-u)).view(rows, cols)


def boundary_blocks(base: float = 3.0) -> torch.Tensor:
    """Super-blocks (rows of 256: 16 blocks of 16) whose first block's absmax is ``base`` (a
    bf16 value, so the super-block's base) and whose other blocks' absmaxes sit on the
    boundaries between scale codes (``base * midpoint`` in fp32) or one ulp either side: the
    hardest inputs for the scale-code search."""
    edges = torch.tensor(INT4_SCALE_MIDPOINTS) * torch.tensor(base)
    targets = torch.stack([edges.nextafter(torch.tensor(0.0)), edges, edges.nextafter(edges * 2)])
    targets = torch.cat([targets.flatten(), torch.full((-targets.numel() % 15,), base)])
    x = torch.zeros(targets.numel() // 15, 16, 16)
    x[:, 0, 0] = base
    x[:, 1:, 0] = targets.view(-1, 15)
    x[:, :, 1] = -0.5 * x[:, :, 0]  # and a smaller element of the other sign
    return x.view(-1, 256)


def decoded_scales(state: dict, block_size: int) -> torch.Tensor:
    """Each block's scale (one a row), decoded from the state independently of the codec."""
    k = state[SCALE_CODES_KEY].reshape(-1).long()
    base = state[BASES_KEY].float().reshape(-1).repeat_interleave(16)
    return (base * SCALE_FACTORS[k]).view(-1, 1)


def test_int4_levels_are_uniform_mid_rise():
    """Code c is the centre of cell c of 16 equal cells spanning [-1, 1]."""
    levels = torch.tensor(INT4_LEVELS, dtype=torch.float64)
    edges = torch.linspace(-1, 1, 17, dtype=torch.float64)
    assert torch.equal(levels, (edges[1:] + edges[:-1]) / 2)
    assert torch.equal(levels, -levels.flip(0))


@pytest.mark.parametrize("block_size", [16, 32])
def test_int4_roundtrip_is_nearest_level_of_decoded_scale(block_size):
    """Per super-block: base = absmax rounded up to bf16. Per block: scale = base * 2**(-k/32).
    Per element: the nearest of the 16 levels times the scale, exactly (brute force), so the
    error is at most 1/16 of the scale inside the outermost levels, and elements beyond 15/16
    of the scale take the outermost."""
    torch.manual_seed(0)
    gauss = torch.randn(64, 1024)
    heavy = torch.distributions.StudentT(4.0).sample((64, 1024))
    graded = graded_blocks(64, 1024, block_size, octaves=9.0)
    levels = torch.tensor(INT4_LEVELS)
    for x in (gauss, heavy * 1e-3, gauss * 1e30, graded):
        y, state = int4_roundtrip(x, block_size)
        supers = x.view(-1, 16 * block_size).abs().amax(-1)
        assert torch.equal(state[BASES_KEY].view(-1), bf16_up(supers))
        # The largest block of each super-block gets code 0: its scale is the base.
        absmax = x.view(-1, 16, block_size).abs().amax(-1)
        codes = state[SCALE_CODES_KEY].view(-1, 16).long()
        assert torch.all(codes.gather(-1, absmax.argmax(-1, keepdim=True)) == 0)
        blocks = x.view(-1, block_size)
        scale = decoded_scales(state, block_size)
        cand = (levels.view(1, 1, -1) * scale.unsqueeze(-1)).expand(*blocks.shape, 16)
        best = cand.gather(-1, (blocks.unsqueeze(-1) - cand).abs().argmin(-1, keepdim=True))
        assert torch.equal(y.view(-1, block_size), best.squeeze(-1))
        err = (y - x).view(-1, block_size).abs()
        inside = blocks.abs() <= 15 / 16 * scale
        assert torch.all(err[inside] <= (scale / 16).expand_as(blocks)[inside] * (1 + 1e-6))
        assert torch.equal(
            y.view(-1, block_size).abs()[~inside], (15 / 16 * scale).expand_as(blocks)[~inside]
        )
    rel = lambda x: (int4_roundtrip(x, block_size)[0] - x).norm().item() / x.norm().item()  # noqa: E731
    # One-shot error on Gaussian blocks: about 8% at block 16 (absmax about 1.8 RMS), 9% at 32.
    assert rel(gauss) < {16: 0.09, 32: 0.10}[block_size], rel(gauss)


def test_int4_scale_code_is_nearest_in_log_domain():
    """k = round(-32 * log2(absmax / base)) against an fp64 reference (up to fp32 rounding at
    the midpoints), 254 for blocks below 2**(-253.5/32) of the base, 255 for all-zero blocks."""
    x = graded_blocks(256, 1024, 16, octaves=9.0, seed=1)
    x[3, 16:32] = 0.0
    _, state = int4_roundtrip(x, 16)
    k = state[SCALE_CODES_KEY].view(-1).long()
    absmax = x.view(-1, 16).abs().amax(-1).double()
    base = state[BASES_KEY].double().view(-1).repeat_interleave(16)
    zero = absmax == 0
    assert torch.all(k[zero] == 255) and zero.sum() == 1
    t = -32 * torch.log2(absmax[~zero] / base[~zero])
    ref = t.round().clamp(max=254).long()
    k = k[~zero]
    near_tie = ((t - t.floor()) - 0.5).abs() < 1e-4
    assert torch.all((k == ref) | near_tie), (k != ref).sum()
    assert torch.all((t - k).abs()[k < 254] <= 0.5 + 1e-4)
    assert torch.all(t[k == 254] >= 253.5 - 1e-4)
    # The data covers the whole range of codes.
    assert k.min() == 0 and (k == 254).sum() > 10 and len(k.unique()) > 250


def test_int4_scale_code_is_exact_at_the_boundaries():
    """k is exactly the number of midpoints above the absmax (``absmax < base * midpoint``,
    both fp32), also for absmaxes on a boundary or one ulp from it."""
    x = boundary_blocks()
    _, state = int4_roundtrip(x, 16)
    assert torch.all(state[BASES_KEY].float() == 3.0)
    absmax = x.view(-1, 16).abs().amax(-1)
    edges = torch.tensor(INT4_SCALE_MIDPOINTS) * torch.tensor(3.0)
    expected = (absmax.unsqueeze(-1) < edges).sum(-1)
    k = state[SCALE_CODES_KEY].view(-1).long()
    assert torch.equal(k, expected)
    assert len(k.unique()) == 255  # every code 0..254, each boundary from both sides


def test_int4_zero_and_sign_symmetry():
    x = torch.randn(8, 512)
    x[3] = 0.0  # an all-zero super-block: base 0, every block code 255, exact zeros
    x[5, 32:48] = 0.0  # an all-zero block inside a non-zero super-block: code 255, exact zeros
    y, state = int4_roundtrip(x, 16)
    assert torch.equal(y[3], torch.zeros(512))
    assert torch.equal(state[BASES_KEY][3], torch.zeros(2, dtype=torch.bfloat16))
    assert torch.all(state[SCALE_CODES_KEY][3] == 255)
    assert torch.equal(y[5, 32:48], torch.zeros(16)) and state[SCALE_CODES_KEY][5, 2] == 255
    assert (state[SCALE_CODES_KEY] == 255).sum() == 32 + 1
    assert torch.isfinite(y).all()
    y_neg, state_neg = int4_roundtrip(-x, 16)
    assert torch.equal(y_neg, -y)
    for key in (SCALE_CODES_KEY, BASES_KEY):
        assert torch.equal(state_neg[key], state[key])


def test_int4_tiny_block_in_a_big_super_block():
    """A block below 2**(-253.5/32) of its super-block's base takes code 254 (the smallest
    non-zero scale, base / 245): its elements keep their signs and are within 1/16 of that
    scale; blocks in range keep their own precision."""
    torch.manual_seed(0)
    x = torch.randn(4, 256)
    x[:, 16:32] *= 1e-6  # far below the range of the codes: 254
    x[:, 32:48] *= 3e-2  # about 1/100 of the base, inside the range: a code of its own
    y, state = int4_roundtrip(x, 16)
    codes = state[SCALE_CODES_KEY]
    assert torch.all(codes[:, 1] == 254)
    assert torch.all((codes[:, 2] > 150) & (codes[:, 2] < 254))
    scale = decoded_scales(state, 16).view(4, 16)
    assert torch.allclose(scale[:, 1], state[BASES_KEY].float().view(-1) * 2 ** (-254 / 32))
    tiny, tiny_y = x[:, 16:32], y[:, 16:32]
    assert torch.isfinite(tiny_y).all() and torch.all(tiny_y.sign() == tiny.sign())
    assert torch.all((tiny_y - tiny).abs() <= scale[:, 1:2] / 16 * (1 + 1e-6))
    # The 3e-2 block: its scale within 1.1% of its absmax, a Gaussian block's usual error.
    small, small_y = x[:, 32:48], y[:, 32:48]
    ratio = scale[:, 2] / small.abs().amax(-1)
    assert torch.all((ratio > 2 ** (-1 / 64) - 1e-6) & (ratio < 2 ** (1 / 64) + 1e-6))
    assert rel_err(small_y, small) < 0.1


def int4_requantize(codes, scale_codes, bases, factors, midpoints, x):
    """Quantize ``x`` into int4 state and decode it again (what each update does)."""
    int4_quantize_(codes, scale_codes, bases, factors, midpoints, x)
    return int4_dequantize(codes, scale_codes, bases, factors)


def test_int4_compiled_requantization_is_bit_for_bit():
    """Compiled int4 quantization and decoding (the scale-code search, the table lookups, the
    element codes) give the same state and values as eager, bit for bit, on data that covers
    every scale code, all-zero blocks, tiny blocks and absmaxes on the code boundaries."""
    codec = Int4Codec(16)
    x = graded_blocks(256, 256, 16, octaves=9.0, seed=2)
    x[7] = 0.0
    x[9, :16] = 0.0
    x[11, 16:32] *= 1e-6
    x = torch.cat([x, boundary_blocks()])  # on the boundaries in the first step
    rows = x.shape[0]
    _, state = int4_roundtrip(x, 16)
    eager = tuple(codec.view(state))
    compiled = tuple(t.clone() for t in eager[:3]) + eager[3:]
    for step in range(3):
        y = int4_requantize(*eager, x.view(-1))
        assert torch.equal(compiled_update(int4_requantize)(*compiled, x.view(-1)), y), step
        for a, b in zip(eager[:3], compiled[:3], strict=True):
            assert torch.equal(a, b), step
        grad = graded_blocks(rows, 256, 16, octaves=9.0, seed=10 + step)
        x = y.lerp(grad.view(-1), 0.05)
    assert len(eager[1].unique()) > 200
