"""The fused quantized-momentum kernels (muon_plugin.kernels.quantized) equal their formats' torch
ops: int8 (torchao's ops) and int4 (``int4_update``).

The Triton interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is
imported): the modules tests/support/kernel_interpreter_quantized.py (int8) and
kernel_interpreter_int4.py. The GPU comparisons below run on CUDA only."""

from __future__ import annotations

import pytest
import torch
from subprocess_env import run_in_interpreter

from muon_plugin.kernels import triton_available
from muon_plugin.kernels.quantized import int4_kernel_applies, int8_kernel_applies
from muon_plugin.lp import Int4Codec, Int8Codec
from muon_plugin.lp.codec import MomentumCodec
from muon_plugin.lp.int4 import unpack_int4
from muon_plugin.lp.keys import CODES_KEY

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_triton
@pytest.mark.interpreter
def test_int8_momentum_kernel_matches_torchao_ops():
    pytest.importorskip("torchao")
    res = run_in_interpreter("kernel_interpreter_quantized.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@needs_triton
@pytest.mark.interpreter
def test_int4_momentum_kernel_matches_the_torch_ops():
    res = run_in_interpreter("kernel_interpreter_int4.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_cpu_tensors_take_the_torch_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    codes, scales = torch.zeros(8, 512, dtype=torch.uint8), torch.zeros(8, 2)
    assert not int8_kernel_applies(codes, scales, torch.zeros(8, 512), True)
    state = Int4Codec(16).zeros(torch.empty(8, 512))
    assert not int4_kernel_applies(*state.values(), torch.zeros(8, 512), True)


def gpu_codec(kind: str) -> MomentumCodec:
    if not triton_available():
        pytest.skip("triton is not importable")
    if kind == "int8":
        pytest.importorskip("torchao")
        return Int8Codec(256)
    return Int4Codec(16)


def levels(codec: MomentumCodec, key: str, t: torch.Tensor) -> torch.Tensor:
    """A code tensor as one integer level per element (int4's codes unpacked)."""
    if isinstance(codec, Int4Codec) and key == CODES_KEY:
        return unpack_int4(t.reshape(-1)).int()
    return t.int()


@needs_gpu
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_kernel_matches_the_torch_ops_on_the_gpu(kind, grad_dtype, nesterov):
    """On CUDA the fused Triton kernel and the format's eager ops agree to rounding, step after
    step (a stacked update and a lone one): from the same state and gradient, directions
    within a few fp32 ulps of their magnitude, fp32 scales within an ulp (int4's bf16 bases
    within one bf16 step), codes and int4's scale codes within one level and almost all equal.

    On the GPU the two are not bit-equal (on an H100 int8's first update from a non-zero state
    differed): the kernel's fp32 arithmetic (contracted multiply-adds) rounds differently from
    ATen's in places. Each step therefore starts both from the fused state, so that differences
    do not compound; the CPU test (Triton's interpreter) checks the same kernel more tightly.
    """
    codec = gpu_codec(kind)
    for shape, stacked in [((2048, 1536), False), ((5, 384, 768), True)]:
        param = torch.empty(shape, device="cuda")
        fused = codec.zeros(param)
        torch.manual_seed(0)
        for step in range(5):
            grad = (torch.randn(shape, device="cuda") * 3.0**-step).to(grad_dtype)
            eager = {key: value.clone() for key, value in fused.items()}
            d_eager = codec.update_(eager, grad, 0.95, nesterov, kernels=False, stacked=stacked)
            d_fused = codec.update_(fused, grad, 0.95, nesterov, kernels=True, stacked=stacked)
            where = (kind, shape, step)
            scale = d_eager.abs().max().item()
            torch.testing.assert_close(d_fused, d_eager, rtol=0, atol=4e-7 * scale, msg=where)
            for key in codec.keys:
                a, b = fused[key], eager[key]
                if a.dtype == torch.uint8:  # codes: indices into sorted levels
                    gap = (levels(codec, key, a) - levels(codec, key, b)).abs()
                    assert gap.max().item() <= 1, (where, key)
                    assert gap.count_nonzero().item() <= 1e-3 * gap.numel(), (where, key)
                else:
                    rtol = 2.4e-7 if a.dtype == torch.float32 else 7.9e-3
                    torch.testing.assert_close(a, b, rtol=rtol, atol=0, msg=where)


@needs_gpu
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_one_fused_launch_over_many_shapes_on_the_gpu(kind):
    """MuonLP's stage 1 on CUDA: one launch updates momenta of several shapes exactly as each
    one's own launch does (states bit for bit), with bf16 directions (the fp32 ones rounded)."""
    codec = gpu_codec(kind)
    shapes = [(768, 768), (768, 3072), (3072, 768), (768, 768), (4, 256, 512)]
    together = [codec.zeros(torch.empty(s, device="cuda")) for s in shapes]
    alone = [codec.zeros(torch.empty(s, device="cuda")) for s in shapes]
    torch.manual_seed(0)
    for step in range(3):
        grads = [torch.randn(s, device="cuda") * 2.0**-step for s in shapes]
        assert all(codec.fused_applies(st, g, True) for st, g in zip(together, grads, strict=True))
        d_together = codec.fused_update_(together, grads, 0.95, True)
        for i, (state, grad) in enumerate(zip(alone, grads, strict=True)):
            d_alone = codec.update_(state, grad, 0.95, True, kernels=True)
            assert torch.equal(d_together[i], d_alone.to(torch.bfloat16)), (shapes[i], step)
            for key in codec.keys:
                assert torch.equal(together[i][key], state[key]), (shapes[i], step, key)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_failed_kernel_warns_once_and_the_torch_ops_take_over(monkeypatch, kind):
    """A kernel that fails to build or launch (an unsupported GPU or Triton) costs speed, not a
    step: one warning, the same results from the torch ops, and no further attempt."""
    from types import SimpleNamespace

    from muon_plugin.kernels import quantized
    from muon_plugin.kernels.fallback import KernelFallback

    if kind == "int8":
        pytest.importorskip("torchao")
    codec = Int8Codec(256) if kind == "int8" else Int4Codec(16)

    def broken(*args):
        raise RuntimeError("no kernel image for this GPU")

    fallback = KernelFallback(f"{kind} momentum kernel")
    monkeypatch.setattr(quantized, f"_{kind}_fallback", fallback)
    module = SimpleNamespace(**{f"grouped_{kind}_momentum": broken})
    monkeypatch.setattr(quantized, "_module", lambda: module)
    torch.manual_seed(0)
    grads = [torch.randn(8, 512), torch.randn(4, 256)]
    fused = [codec.zeros(torch.empty(g.shape)) for g in grads]
    eager = [codec.zeros(torch.empty(g.shape)) for g in grads]
    with pytest.warns(UserWarning, match=f"{kind} momentum kernel failed .*no kernel image"):
        directions = codec.fused_update_(fused, grads, 0.9, True)
    for state, ref_state, grad, direction in zip(fused, eager, grads, directions, strict=True):
        expected = codec.update_(ref_state, grad, 0.9, True, kernels=False)
        assert torch.equal(direction, expected.to(torch.bfloat16))
        for key in codec.keys:
            assert torch.equal(state[key], ref_state[key]), key
    assert fallback.failed
    monkeypatch.setattr(quantized, "_INTERPRETED", True)  # CPU tensors would otherwise qualify
    assert not codec.fused_applies(fused[0], grads[0], True)
