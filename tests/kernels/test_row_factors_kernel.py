"""NorMuon's row kernels (muon_plugin.kernels.row_factors) equal the torch form.

The interpreter check runs in a subprocess (TRITON_INTERPRET must be set before triton is
imported): tests/support/kernel_interpreter_row_factors.py. On a GPU the kernel is checked
against the torch form directly (the rows' sums of squares are summed in another order than
torch's norm, so the states and factors agree to a few fp32 roundings, not bit for bit); on the
CPU ``kernel=True`` takes the torch form.
"""

from __future__ import annotations

import pytest
import torch
from subprocess_env import run_in_interpreter

from muon_plugin.kernels import triton_available
from muon_plugin.learning_rate import LrShapeRule
from muon_plugin.orthogonalize import MatrixSpec
from muon_plugin.orthogonalize.normuon import normuon_factors_
from muon_plugin.orthogonalize.spec import RowNormalization


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
@pytest.mark.interpreter
def test_row_factor_kernel_matches_torch_in_the_interpreter():
    res = run_in_interpreter("kernel_interpreter_row_factors.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def spec(rescale: str, split: tuple[int, ...] | None = None) -> MatrixSpec:
    norm = RowNormalization(beta2=0.95, eps=1e-8, rescale=rescale)
    return MatrixSpec(
        normalization=norm, split_sizes=split, output_scale=LrShapeRule("match_rms_adamw")
    )


def factors(device: str, kernel: bool, rescale: str, split) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ortho = torch.randn(4, 192, 96, generator=g).to(torch.bfloat16).to(device)
    v = torch.rand(4, 192, generator=g).to(device)
    f = normuon_factors_(ortho, v, spec(rescale, split), kernel)
    return f.cpu(), v.cpu()


@pytest.mark.parametrize("rescale", ["rms", "frobenius"])
def test_cpu_stacks_take_the_torch_form(rescale):
    for split in (None, (128, 32, 32)):
        with_kernel = factors("cpu", True, rescale, split)
        without = factors("cpu", False, rescale, split)
        assert all(torch.equal(a, b) for a, b in zip(with_kernel, without, strict=True))


@pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("rescale", ["rms", "frobenius"])
def test_kernel_matches_torch_on_the_gpu(rescale):
    for split in (None, (128, 32, 32)):
        (f_k, v_k), (f_t, v_t) = (
            factors("cuda", True, rescale, split),
            factors("cuda", False, rescale, split),
        )
        torch.testing.assert_close(v_k, v_t, rtol=1e-6, atol=0)
        torch.testing.assert_close(f_k, f_t, rtol=4e-6, atol=0)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("cols", [768, 3072, 300])
def test_row_sums_of_squares_on_the_gpu(cols):
    from muon_plugin.kernels.row_factors import row_sum_squares_kernel

    g = torch.Generator().manual_seed(cols)
    X = torch.randn(5, 193, cols, generator=g).to(torch.bfloat16)
    got = row_sum_squares_kernel(X.cuda())
    assert got is not None
    torch.testing.assert_close(got.cpu().double(), X.double().square().sum(-1), rtol=1e-6, atol=0)
