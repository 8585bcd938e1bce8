"""Per-matrix scaling (muon_plugin.kernels.matrix_scale): the Triton kernel equals torch's ops.

The interpreter check runs in a subprocess (TRITON_INTERPRET must be set before triton is
imported): the helper module tests/kernel_interpreter_scale.py. On a GPU the kernel is checked
against the same ops directly."""

from __future__ import annotations

import pytest
import torch
from subprocess_env import run_in_interpreter

from muon_plugin.kernels import triton_available
from muon_plugin.kernels.matrix_scale import prescale_huge_, scale_matrices_

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
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
    prescale_huge_(big, 2.0**32, kernel=True)
    assert torch.equal(big[0], X[0]) and torch.equal(big[2], X[2])
    assert 1.0 <= big[1].abs().max().item() < 2.0  # brought into [1, 2) by a power of two


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
    kernel, eager = X.clone(), X.clone()
    prescale_huge_(kernel, 2.0**32, kernel=True)
    prescale_huge_(eager, 2.0**32, kernel=False)
    assert torch.equal(kernel, eager)


def test_a_kernel_that_fails_warns_once_and_leaves_it_to_torch(monkeypatch):
    from muon_plugin.kernels import matrix_scale

    class Broken:
        calls = 0

        def scale_matrices_(self, *args):
            Broken.calls += 1
            raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(matrix_scale, "_failed", [])
    monkeypatch.setattr(matrix_scale, "_module", Broken)
    monkeypatch.setattr(
        matrix_scale, "_use_kernel", lambda X, kernel: kernel and not matrix_scale._failed
    )
    X = torch.randn(3, 8, 16, dtype=torch.bfloat16)
    f = torch.tensor([0.5, 3.0, 1.0]).view(3, 1, 1)
    out = X.clone()
    with pytest.warns(UserWarning, match="no kernel for this GPU"):
        scale_matrices_(out, f, kernel=True)
    assert torch.equal(out, X * f.to(X.dtype))
    scale_matrices_(out, f, kernel=True)  # no second attempt, no second warning
    prescale_huge_(out, 2.0**32, kernel=True)
    assert Broken.calls == 1
