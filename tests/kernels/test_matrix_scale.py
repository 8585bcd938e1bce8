"""Per-matrix scaling (muon_plugin.kernels.matrix_scale): the Triton kernel equals torch's ops.

The interpreter check runs in a subprocess (TRITON_INTERPRET must be set before triton is imported):
the module tests/support/kernel_interpreter_scale.py. On a GPU the kernel is checked against
the same ops directly."""

from __future__ import annotations

import pytest
import torch
from subprocess_env import run_in_interpreter

from muon_plugin.kernels import triton_available
from muon_plugin.kernels.fallback import KernelFallback
from muon_plugin.kernels.matrix_scale import prescale_, scale_matrices_

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
@pytest.mark.interpreter
def test_scale_kernel_matches_torch_in_the_interpreter():
    res = run_in_interpreter("kernel_interpreter_scale.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_cpu_batches_take_the_torch_ops():
    X = torch.randn(3, 8, 16, dtype=torch.bfloat16)
    f = torch.tensor([0.5, 3.0, 1.0]).view(3, 1, 1)
    out = X.clone()
    scale_matrices_(out, f, kernel=True)  # the kernel is for CUDA tensors only
    assert torch.equal(out, X * f.to(X.dtype))
    big = X.clone()
    big[1] *= 2.0**40
    big[2] *= 2.0**-60
    prescale_(big, 2.0**-20, 2.0**32, kernel=True)
    assert torch.equal(big[0], X[0])
    for i in (1, 2):  # brought into [1, 2) by a power of two
        assert 1.0 <= big[i].abs().max().item() < 2.0
        assert torch.equal(big[i] / big[i].abs().max(), X[i] / X[i].abs().max())
    zero = torch.zeros(2, 4, 4)
    prescale_(zero, 2.0**-20, 2.0**32)
    assert torch.equal(zero, torch.zeros(2, 4, 4))


def test_tiny_prescaling_stops_at_the_dtypes_largest_finite_factor():
    """A subnormal max-abs would need a factor beyond the dtype's range (2^149 in fp32): the
    factor stops at 2^127 (fp32, bf16) or 2^15 (fp16), finite, the matrix no longer tiny."""
    cases = ((torch.float16, 15, 2.0**-24), (torch.bfloat16, 127, 2.0**-131))
    for dtype, limit, smallest in (*cases, (torch.float32, 127, 2.0**-131)):
        X = torch.full((1, 2, 2), smallest, dtype=dtype)
        prescale_(X, 2.0**-20, 2.0**32)
        assert torch.isfinite(X).all(), dtype
        assert X.abs().max().item() == smallest * 2.0**limit, dtype


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_kernel_matches_torch_on_the_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(48, 768, 768, device="cuda", generator=g).to(dtype)
    f = torch.rand(48, 1, 1, device="cuda", generator=g) + 0.01
    out = X.clone()
    scale_matrices_(out, f, kernel=True)
    assert torch.equal(out, X.mul(f.to(dtype)))
    if dtype != torch.float16:
        X[5] *= 1e12
    X[6] *= 2.0**-50 if dtype != torch.float16 else 2.0**-10
    kernel, eager = X.clone(), X.clone()
    prescale_(kernel, 2.0**-20, 2.0**32, kernel=True)
    prescale_(eager, 2.0**-20, 2.0**32, kernel=False)
    assert torch.equal(kernel, eager)


def test_a_kernel_that_fails_warns_once_and_leaves_it_to_torch(monkeypatch):
    from muon_plugin.kernels import matrix_scale

    class Broken:
        calls = 0

        def scale_matrices_(self, *args):
            Broken.calls += 1
            raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(matrix_scale, "_fallback", KernelFallback("per-matrix scaling kernel"))
    monkeypatch.setattr(matrix_scale, "_module", Broken)
    monkeypatch.setattr(
        matrix_scale, "_use_kernel", lambda X, kernel: kernel and not matrix_scale._fallback.failed
    )
    X = torch.randn(3, 8, 16, dtype=torch.bfloat16)
    f = torch.tensor([0.5, 3.0, 1.0]).view(3, 1, 1)
    out = X.clone()
    with pytest.warns(UserWarning, match="no kernel for this GPU"):
        scale_matrices_(out, f, kernel=True)
    assert torch.equal(out, X * f.to(X.dtype))
    scale_matrices_(out, f, kernel=True)  # no second attempt, no second warning
    prescale_(out, 2.0**-20, 2.0**32, kernel=True)
    assert Broken.calls == 1
