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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_kernel_matches_torchao_ops_on_the_gpu(grad_dtype, nesterov):
    """On CUDA the fused Triton kernel and torchao's eager ops agree to rounding, step after
    step (a stacked update and a lone one): from the same state and gradient, directions
    within a few fp32 ulps of their magnitude, scales within an ulp, codes within one level of
    the map (a value on a level boundary may round either way) and almost all equal.

    On the GPU the two are not bit-equal (on an H100 the first update from a non-zero state
    differed): the kernel's fp32 arithmetic (contracted multiply-adds) rounds differently from
    ATen's in places. Each step therefore starts both from the fused state, so that differences
    do not compound; the CPU test (Triton's interpreter) checks the same kernel bit for bit.
    """
    from muon_plugin.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not importable")
    codec = Int8Codec(256)
    for shape, stacked in [((2048, 1536), False), ((5, 384, 768), True)]:
        param = torch.empty(shape, device="cuda")
        fused = codec.zeros(param)
        torch.manual_seed(0)
        for step in range(5):
            grad = (torch.randn(shape, device="cuda") * 3.0**-step).to(grad_dtype)
            eager = {key: value.clone() for key, value in fused.items()}
            d_eager = codec.update_(eager, grad, 0.95, nesterov, kernels=False, stacked=stacked)
            d_fused = codec.update_(fused, grad, 0.95, nesterov, kernels=True, stacked=stacked)
            where = (shape, step)
            scale = d_eager.abs().max().item()
            torch.testing.assert_close(d_fused, d_eager, rtol=0, atol=4e-7 * scale, msg=where)
            for key in codec.keys:
                a, b = fused[key], eager[key]
                if a.dtype == torch.uint8:  # codes: indices into the sorted map
                    gap = (a.int() - b.int()).abs()
                    assert gap.max().item() <= 1, where
                    assert gap.count_nonzero().item() <= 1e-3 * gap.numel(), where
                else:
                    torch.testing.assert_close(a, b, rtol=2.4e-7, atol=0, msg=where)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_fused_launch_over_many_shapes_on_the_gpu():
    """MuonLP's stage 1 on CUDA: one launch updates momenta of several shapes exactly as each
    one's own launch does (states bit for bit), with bf16 directions (the fp32 ones rounded)."""
    from muon_plugin.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not importable")
    codec = Int8Codec(256)
    shapes = [(768, 768), (768, 3072), (3072, 768), (768, 768), (4, 256, 512)]
    together = [codec.zeros(torch.empty(s, device="cuda")) for s in shapes]
    alone = [codec.zeros(torch.empty(s, device="cuda")) for s in shapes]
    torch.manual_seed(0)
    for step in range(3):
        grads = [torch.randn(s, device="cuda") * 2.0**-step for s in shapes]
        d_together = codec.fused_update_(together, grads, 0.95, True)
        for i, (state, grad) in enumerate(zip(alone, grads, strict=True)):
            d_alone = codec.update_(state, grad, 0.95, True, kernels=True)
            assert torch.equal(d_together[i], d_alone.to(torch.bfloat16)), (shapes[i], step)
            for key in codec.keys:
                assert torch.equal(together[i][key], state[key]), (shapes[i], step, key)
