"""NorMuon's row kernels against the torch form, in the Triton interpreter.

Run by ``tests/kernels/test_row_factors_kernel.py`` in a subprocess with ``TRITON_INTERPRET=1``
(set before triton is imported), on CPU tensors; prints ``OK``. Cases: one row block and fused
QKV blocks of their own scales, both rescales, both branches of ``lerp`` (beta2 above and below
0.5), more rows than one program's block, a zero matrix (zero factors) and a non-finite one
(non-finite factors). The rows' sums of squares: bf16 and fp32 stacks whose columns fill the
column chunk or not, more rows than one program's, a non-finite entry (its row only).
Importing this module runs nothing.
"""

from __future__ import annotations

import torch

from muon_plugin.orthogonalize.normuon import row_factors_
from muon_plugin.orthogonalize.spec import RowNormalization


def case(m: int, cols: int, blocks, beta2: float, rescale: str, seed: int) -> None:
    from muon_plugin.kernels import _row_factors_triton as kernel

    g = torch.Generator().manual_seed(seed)
    sum_sq = torch.rand(3, m, generator=g) * cols
    sum_sq[1] = 0.0  # a zero matrix
    v = torch.rand(3, m, generator=g)
    v[1] = 0.0
    eps = 1e-8
    norm = RowNormalization(beta2=beta2, eps=eps, rescale=rescale)
    v_ref = v.clone()
    ref = row_factors_(sum_sq.clone(), v_ref, blocks, cols, norm)
    got = kernel.row_factors_(sum_sq, v, blocks, cols, beta2, eps, rescale == "frobenius")
    where = f"m={m} blocks={blocks} beta2={beta2} {rescale}"
    torch.testing.assert_close(v, v_ref, rtol=2e-7, atol=0, msg=where)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=0, msg=where)
    assert torch.equal(got[1], torch.zeros(m)), where
    bad = sum_sq.clone()
    bad[2, 0] = float("nan")
    out = kernel.row_factors_(bad, v.clone(), blocks, cols, beta2, eps, rescale == "frobenius")
    assert torch.isnan(out[2, : blocks[0][1]]).all() and torch.isfinite(out[0]).all(), where


def sum_case(matrices: int, m: int, cols: int, dtype: torch.dtype, seed: int) -> None:
    from muon_plugin.kernels import _row_factors_triton as kernel

    g = torch.Generator().manual_seed(seed)
    X = torch.randn(matrices, m, cols, generator=g).to(dtype)
    ref = X.double().square().sum(-1)
    got = kernel.row_sum_squares(X)
    where = f"{matrices}x{m}x{cols} {dtype}"
    assert got.dtype == torch.float32 and got.shape == (matrices, m), where
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0, msg=where)
    X[0, 1, cols - 1] = float("inf")
    bad = kernel.row_sum_squares(X)
    assert torch.isinf(bad[0, 1]) and torch.isfinite(bad[0, 0]) and torch.isfinite(bad[1]).all()


def main() -> None:
    sum_case(3, 70, 96, torch.bfloat16, 3)  # 96 columns: one masked 128-column chunk
    sum_case(2, 9, 1536, torch.bfloat16, 4)  # 3 chunks of 512, rows across programs
    sum_case(2, 5, 300, torch.float32, 5)
    for rescale in ("rms", "frobenius"):
        case(96, 64, [(0, 96, 1.0)], 0.95, rescale, 0)
        case(160, 128, [(0, 128, 0.5), (128, 16, 2.0), (144, 16, 2.0)], 0.95, rescale, 1)
        case(2500, 300, [(0, 2500, 1.5)], 0.3, rescale, 2)  # 3 programs' blocks; lerp from end
    print("OK")


if __name__ == "__main__":
    main()
