"""The symmetric-product Triton kernel against fp64 references, in the Triton interpreter.

Run by ``tests/kernels/test_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (it must be set
before ``triton.jit`` decorates the kernel, which must not leak into other tests): ``python
tests/support/kernel_interpreter_symmetric.py`` prints one JSON line per case: relative error, exact
symmetry, and whether every output element was written (the output is poisoned with NaN first).
Importing this module runs nothing.
"""

from __future__ import annotations

import json

import torch


def cfg(bm: int, bn: int, bk: int) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=1)


def report(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    out = out.reshape(-1, *out.shape[-2:])
    ref = ref.reshape(-1, *ref.shape[-2:])
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    row = {
        "name": name,
        "dtype": str(out.dtype),
        "err": err,
        "symmetric": bool(torch.equal(out, out.mT)),
        "written": bool(torch.isfinite(out).all()),
    }
    print(json.dumps(row))


def sym(b: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    c = torch.randn(b, m, m, dtype=torch.float64)
    return (c + c.mT).to(dtype)


def launches(st) -> None:
    """The launcher with explicit tile configs: (name, X shape, dtype, config, with C)."""
    cases = [
        (
            "multi-tile, m and k not block multiples",
            (1, 80, 70),
            torch.float32,
            cfg(16, 16, 16),
            False,
        ),
        ("rectangular 16x32 tiles", (1, 80, 70), torch.float32, cfg(16, 32, 16), False),
        ("m < block", (2, 10, 20), torch.float32, cfg(16, 16, 16), False),
        ("batch, bf16", (3, 40, 48), torch.bfloat16, cfg(16, 32, 16), False),
        ("epilogue fp32", (2, 50, 36), torch.float32, cfg(16, 16, 16), True),
        ("epilogue bf16", (2, 50, 36), torch.bfloat16, cfg(16, 32, 16), True),
        ("fp16", (1, 33, 40), torch.float16, cfg(16, 16, 16), False),
    ]
    for name, shape, dtype, config, with_c in cases:
        X = torch.randn(shape, dtype=dtype)
        m = shape[1]
        out = torch.full((shape[0], m, m), float("nan"), dtype=dtype)
        ref = X.double() @ X.double().mT
        if with_c:
            C = sym(shape[0], m, dtype)
            st.launch(X, C, out, 0.5, -2.0, config)
            ref = 0.5 * ref - 2.0 * C.double()
        else:
            st.launch(X, None, out, 1.0, 0.0, config)
        report(name, out, ref)


def wrapper() -> None:
    """The public wrapper (default interpreter config, 32x32 tiles)."""
    from muon_plugin.kernels import gram, symmetric_matmul

    X = torch.randn(70, 45)
    report("wrapper 2-D", symmetric_matmul(X), X.double() @ X.double().mT)
    # gram does what it is told: kernel=True is the kernel (here on the CPU), False is torch.
    assert torch.equal(gram(X, kernel=True), symmetric_matmul(X))
    assert torch.equal(gram(X, kernel=False), X @ X.mT)

    base = torch.randn(2, 64, 40, dtype=torch.bfloat16)
    Xt = base.mT  # (2, 40, 64), non-contiguous: unit stride along m
    assert not Xt.is_contiguous()
    report("non-contiguous X.mT, bf16", symmetric_matmul(Xt), Xt.double() @ Xt.double().mT)

    Xs = torch.randn(2, 36, 100)[:, :, ::2]  # k stride 2
    report("strided k", symmetric_matmul(Xs), Xs.double() @ Xs.double().mT)

    X4 = torch.randn(2, 2, 20, 24)
    C4 = sym(1, 20, torch.float32)[0]  # 2-D C broadcast over a 2x2 batch
    y = symmetric_matmul(X4, alpha=-1.5, C=C4, beta=0.25)
    assert y.shape == (2, 2, 20, 20)
    ref = -1.5 * (X4.double() @ X4.double().mT) + 0.25 * C4.double()
    report("4-D X, broadcast C", y, ref)

    # The Polar Express step Q = gamma*I + beta*A + alpha*A@A, the diagonal added before rounding.
    A = sym(2, 40, torch.float32) / 10
    Q = symmetric_matmul(A, alpha=2.0, C=A, beta=-3.0, gamma=8.25)
    eye = torch.eye(40, dtype=torch.float64)
    ref = 2.0 * (A.double() @ A.double().mT) - 3.0 * A.double() + 8.25 * eye
    report("gamma * I epilogue", Q, ref)

    X = torch.randn(1, 24, 32)
    out = torch.full((1, 24, 24), float("nan"))
    res = symmetric_matmul(X, out=out)
    assert res is out
    report("out=", out, X.double() @ X.double().mT)

    # Gram-space products: Y commutes with X (a polynomial in it), the result rounded to fp16.
    S = sym(2, 40, torch.float64) / 10
    P = S @ S - 2 * S  # commutes with S, so S @ P^T = S @ P is symmetric
    y = symmetric_matmul(S.to(torch.float16), Y=P.to(torch.float16), alpha=0.5)
    report("Y operand, fp16", y, 0.5 * (S @ P))
    Xb = torch.randn(2, 36, 64, dtype=torch.bfloat16)
    y = symmetric_matmul(Xb, alpha=36.0, out_dtype=torch.float16)
    assert y.dtype == torch.float16
    report("bf16 in, fp16 out", y, 36.0 * (Xb.double() @ Xb.double().mT))


def tma_kernel(st) -> None:
    """The TMA (tensor-descriptor) kernel, launched directly."""
    import triton

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    # Batch rows run into the next batch.
    X = torch.randn(3, 33, 40)
    C = sym(3, 33, torch.float32)
    out = torch.full((3, 33, 33), float("nan"))
    args = (X, X, C, out, 33, 40, 99, *C.stride(), *out.stride(), 0.5, -2.0, 1.5)
    st._syrk_tma_kernel[(st._num_programs(33, 16, 32), 3)](
        *args, HAS_C=True, HAS_DIAG=True, TMA_STORE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=16
    )
    eye = torch.eye(33, dtype=torch.float64)
    ref = 0.5 * (X.double() @ X.double().mT) - 2.0 * C.double() + 1.5 * eye
    report("TMA kernel", out, ref)

    # TMA stores (square tiles): clipped at row/column 36 of each batch, diagonal tiles
    # symmetrized.
    X = torch.randn(3, 36, 40)
    C = sym(3, 36, torch.float32)
    out = torch.full((3, 36, 36), float("nan"))
    assert st.tma_store_eligible(out)
    args = (X, X, C, out, 36, 40, 108, *C.stride(), *out.stride(), 0.5, -2.0, 1.5)
    st._syrk_tma_kernel[(st._num_programs(36, 16, 16), 3)](
        *args, HAS_C=True, HAS_DIAG=True, TMA_STORE=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16
    )
    eye = torch.eye(36, dtype=torch.float64)
    ref = 0.5 * (X.double() @ X.double().mT) - 2.0 * C.double() + 1.5 * eye
    report("TMA stores", out, ref)


def main() -> None:
    from muon_plugin.kernels import _symmetric_triton as st

    assert st.INTERPRET
    torch.manual_seed(0)
    launches(st)
    wrapper()
    tma_kernel(st)


if __name__ == "__main__":
    main()
