"""The per-matrix scaling kernel against torch's ops, bit for bit, in the Triton interpreter.

Run by ``tests/kernels/test_matrix_scale.py`` in a subprocess with ``TRITON_INTERPRET=1`` (it must
be set before triton is imported), on CPU tensors; prints ``OK``. The interpreter's fp32 -> bf16
cast is patched to round like the GPU (``interpreter_rounding``). Importing this module runs
nothing.
"""

from __future__ import annotations

import math

import torch
from interpreter_rounding import round_casts_to_nearest_even

from muon_plugin.kernels.matrix_scale import max_exponent

HUGE = 2.0**32
TINY = 2.0**-20


def torch_prescale(X: torch.Tensor, below: float, above: float) -> None:
    """The rule, written out: a power of two for a max-abs above ``above`` or below ``below``
    (not zero), its exponent at most the dtype's largest finite one."""
    amax = torch.linalg.vector_norm(
        X, ord=math.inf, dim=(-2, -1), keepdim=True, dtype=torch.float32
    )
    limit = max_exponent(X.dtype)
    exponent = (-torch.floor(torch.log2(amax))).clamp_max(limit)
    scaled = (amax > above) | ((amax < below) & (amax > 0))
    X.mul_(torch.where(scaled, torch.exp2(exponent), 1.0).to(X.dtype))


def batch(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def check_scale(shape, dtype, seed: int) -> None:
    from muon_plugin.kernels import _scale_triton

    X = batch(shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    factors = torch.rand(shape[0], 1, 1, generator=g) * 3 + 1e-3  # fp32, rounded per dtype
    expected = X.clone().mul_(factors.to(dtype))
    _scale_triton.scale_matrices_(X, factors, None, max_exponent(dtype))
    assert torch.equal(X, expected), (shape, dtype)


def check_prescale(shape, dtype, seed: int) -> None:
    from muon_plugin.kernels import _scale_triton

    X = batch(shape, dtype, seed)
    if dtype != torch.float16:  # fp16 cannot hold entries above 2^32
        X[0] *= 3e20  # huge: scaled by a power of two
        X[-1, 0, 0] = 7e9  # one huge entry
    if shape[0] > 2:
        X[1, 0, 0] = float("nan")  # max-abs NaN: left as it is
        X[2] *= 2.0**-40 if dtype != torch.float16 else 2.0**-12  # tiny: scaled up
    if shape[0] > 3:
        X[3] = 0.0  # all zero: left as it is
    expected = X.clone()
    torch_prescale(expected, TINY, HUGE)
    amax = torch.linalg.vector_norm(X, ord=math.inf, dim=(-2, -1), dtype=torch.float32)
    _scale_triton.scale_matrices_(X, amax, (TINY, HUGE), max_exponent(dtype))
    assert torch.equal(X.nan_to_num(), expected.nan_to_num()), (shape, dtype)
    assert torch.equal(X.isnan(), expected.isnan())


def main() -> None:
    round_casts_to_nearest_even()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # one block per matrix, several blocks with a ragged tail, a batch of one
        for seed, shape in enumerate([(4, 32, 64), (3, 50, 97), (1, 64, 80)]):
            check_scale(shape, dtype, seed)
            check_prescale(shape, dtype, seed)
    print("OK")


if __name__ == "__main__":
    main()
