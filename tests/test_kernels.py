"""Tests for muon_plugin.kernels: the symmetric-product Triton kernel and its dispatcher.

The kernel checks run the Triton interpreter on the CPU in a subprocess: TRITON_INTERPRET
must be set before triton.jit decorates the kernel, which must not leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from muon_plugin.kernels import gram, triton_available, use_symmetric_kernel

REPO = Path(__file__).resolve().parents[1]


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    full_env.pop("MUON_PLUGIN_DISABLE_TRITON", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


# Runs in the interpreter; prints one JSON line per case: relative error, exact symmetry,
# whether every output element was written (the output is poisoned with NaN first).
_INTERPRETER_CASES = r"""
import json
import torch
from muon_plugin.kernels import _symmetric_triton as st
from muon_plugin.kernels import symmetric_matmul

assert st.INTERPRET
torch.manual_seed(0)


def cfg(bm, bn, bk):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=1)


def report(name, out, ref):
    out = out.reshape(-1, *out.shape[-2:])
    ref = ref.reshape(-1, *ref.shape[-2:])
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    print(json.dumps({
        "name": name,
        "dtype": str(out.dtype),
        "err": err,
        "symmetric": bool(torch.equal(out, out.mT)),
        "written": bool(torch.isfinite(out).all()),
    }))


def sym(b, m, dtype):
    c = torch.randn(b, m, m, dtype=torch.float64)
    return (c + c.mT).to(dtype)


# (name, X shape, dtype, config, with C)
cases = [
    ("multi-tile, m and k not block multiples", (1, 80, 70), torch.float32, cfg(16, 16, 16), False),
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

# The public wrapper (default interpreter config, 32x32 tiles).
X = torch.randn(70, 45)
report("wrapper 2-D", symmetric_matmul(X), X.double() @ X.double().mT)

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
report("4-D X, broadcast C", y, -1.5 * (X4.double() @ X4.double().mT) + 0.25 * C4.double())

# The Polar Express step Q = gamma*I + beta*A + alpha*A@A, the diagonal added before rounding.
A = sym(2, 40, torch.float32) / 10
Q = symmetric_matmul(A, alpha=2.0, C=A, beta=-3.0, gamma=8.25)
eye = torch.eye(40, dtype=torch.float64)
report("gamma * I epilogue", Q, 2.0 * (A.double() @ A.double().mT) - 3.0 * A.double() + 8.25 * eye)

X = torch.randn(1, 24, 32)
out = torch.full((1, 24, 24), float("nan"))
res = symmetric_matmul(X, out=out)
assert res is out
report("out=", out, X.double() @ X.double().mT)

# Gram-space products: Y commutes with X (a polynomial in it), the result is rounded to fp16.
S = sym(2, 40, torch.float64) / 10
P = S @ S - 2 * S  # commutes with S, so S @ P^T = S @ P is symmetric
y = symmetric_matmul(S.to(torch.float16), Y=P.to(torch.float16), alpha=0.5)
report("Y operand, fp16", y, 0.5 * (S @ P))
Xb = torch.randn(2, 36, 64, dtype=torch.bfloat16)
y = symmetric_matmul(Xb, alpha=36.0, out_dtype=torch.float16)
assert y.dtype == torch.float16
report("bf16 in, fp16 out", y, 36.0 * (Xb.double() @ Xb.double().mT))

# The TMA (tensor-descriptor) kernel, launched directly: batch rows run into the next batch.
import triton
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
X = torch.randn(3, 33, 40)
C = sym(3, 33, torch.float32)
out = torch.full((3, 33, 33), float("nan"))
args = (X, X, C, out, 33, 40, 99, *C.stride(), *out.stride(), 0.5, -2.0, 1.5)
st._syrk_tma_kernel[(st._num_programs(33, 16, 32), 3)](
    *args, HAS_C=True, HAS_DIAG=True, TMA_STORE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=16
)
eye = torch.eye(33, dtype=torch.float64)
report("TMA kernel", out, 0.5 * (X.double() @ X.double().mT) - 2.0 * C.double() + 1.5 * eye)

# TMA stores (square tiles): clipped at row/column 36 of each batch, diagonal tiles symmetrized.
X = torch.randn(3, 36, 40)
C = sym(3, 36, torch.float32)
out = torch.full((3, 36, 36), float("nan"))
assert st.tma_store_eligible(out)
args = (X, X, C, out, 36, 40, 108, *C.stride(), *out.stride(), 0.5, -2.0, 1.5)
st._syrk_tma_kernel[(st._num_programs(36, 16, 16), 3)](
    *args, HAS_C=True, HAS_DIAG=True, TMA_STORE=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16
)
eye = torch.eye(36, dtype=torch.float64)
report("TMA stores", out, 0.5 * (X.double() @ X.double().mT) - 2.0 * C.double() + 1.5 * eye)
"""


# Triton 3.6's interpreter turns a loop bound into a 1-element array and calls int() on it,
# which numpy 2.4 rejects.
_NUMPY_SCALAR_BUG = "only 0-dimensional arrays can be converted to Python scalars"


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_kernel_matches_reference_in_interpreter():
    proc = _run_python(_INTERPRETER_CASES, TRITON_INTERPRET="1")
    if proc.returncode and _NUMPY_SCALAR_BUG in proc.stderr:
        pytest.skip(
            "this Triton's interpreter cannot run a loop bound from a run-time argument under "
            "numpy >= 2.4 (seen with triton 3.6 on numpy 2.4 and 2.5; fixed by triton 3.9)"
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 17, proc.stdout
    for r in rows:
        tol = {"torch.float32": 1e-5, "torch.float16": 2e-3}.get(r["dtype"], 1e-2)
        assert r["written"], r
        assert r["symmetric"], r
        assert r["err"] < tol, r


def test_gram_cpu_falls_back_to_torch_exactly():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        X = torch.randn(3, 20, 30, dtype=dtype)
        C = torch.randn(3, 20, 20, dtype=dtype)
        y = gram(X)
        assert y.dtype == dtype and y.shape == (3, 20, 20)
        assert torch.equal(y, torch.bmm(X, X.mT))
        assert torch.equal(gram(X, alpha=0.5), torch.baddbmm(y, X, X.mT, beta=0.0, alpha=0.5))
        assert torch.equal(
            gram(X, alpha=2.0, C=C, beta=-3.0), torch.baddbmm(C, X, X.mT, beta=-3.0, alpha=2.0)
        )
        X2, C2 = X[0], C[0]
        assert torch.equal(gram(X2), torch.mm(X2, X2.mT))
        assert torch.equal(
            gram(X2, alpha=2.0, C=C2, beta=-3.0), torch.addmm(C2, X2, X2.mT, beta=-3.0, alpha=2.0)
        )
        X4 = X.reshape(3, 1, 20, 30)
        assert torch.equal(gram(X4), y.reshape(3, 1, 20, 20))


def test_gram_torch_path_rounding():
    """Another output dtype goes through one fp32 product (one rounding, as in the kernel);
    the input's own dtype is one baddbmm, and ``gamma * I`` is added after it."""
    torch.manual_seed(1)
    X = torch.randn(3, 16, 40).to(torch.bfloat16)
    eye = torch.eye(16)
    product = X.float() @ X.float().mT  # bf16 products are exact in fp32
    out32 = gram(X, out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and torch.equal(out32, product)
    half = gram(X, alpha=2.0, gamma=1.5, out_dtype=torch.float16)
    assert half.dtype == torch.float16
    assert torch.equal(half, (product * 2.0 + 1.5 * eye).to(torch.float16))
    R = half
    Z = gram(R, alpha=0.5, C=R, beta=-2.0, gamma=3.0)
    ref = torch.baddbmm(R, R, R.mT, beta=-2.0, alpha=0.5)
    ref.diagonal(dim1=-2, dim2=-1).add_(3.0)
    assert Z.dtype == torch.float16 and torch.equal(Z, ref)


def test_gram_rejects_bad_c():
    with pytest.raises(ValueError):
        gram(torch.randn(4, 6), C=torch.randn(6, 6))


def test_dispatch_predicate():
    """The region measured on an H200 (see ``use_symmetric_kernel``)."""
    for shape in [
        (4096, 4096),
        (4096, 14336),
        (1024, 4096, 16),
        (1024, 4096, 8),
        (2048, 2048, 8),
        (2048, 2048, 4),
        (2048, 8192, 2),
        (1024, 1024, 32),
        (8192, 8192),
    ]:
        assert use_symmetric_kernel(*shape), shape
    for shape in [
        (1024, 65536),
        (2048, 2048),
        (2048, 8192),
        (1024, 4096),
        (1024, 1024, 8),
        (1024, 1024, 16),
        (768, 3072, 24),
        (128, 256, 256),
    ]:
        assert not use_symmetric_kernel(*shape), shape


def test_import_without_triton():
    code = """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        sys.modules["triton.language"] = None
        import torch
        import muon_plugin.kernels as k
        assert not k.triton_available()
        X = torch.randn(5, 7)
        assert torch.equal(k.gram(X), X @ X.mT)
        try:
            k.symmetric_matmul(X)
        except RuntimeError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("symmetric_matmul ran without triton")
        print("ok")
    """
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "ok"


def test_disable_env_var_forces_torch(monkeypatch):
    import muon_plugin.kernels.symmetric as S

    monkeypatch.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")
    assert not S.triton_kernels_enabled()
