"""Tests for muon_plugin.kernels: the symmetric-product Triton kernel and its dispatcher.

The kernel checks run the Triton interpreter on the CPU in a subprocess (the module
tests/support/kernel_interpreter_symmetric.py): TRITON_INTERPRET must be set before triton.jit
decorates the kernel, which must not leak into other tests.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from subprocess_env import run_in_interpreter, run_test_script

from muon_plugin.kernels import baddbmm, gram, triton_available, use_symmetric_kernel

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
@pytest.mark.interpreter
def test_kernel_matches_reference_in_interpreter():
    proc = run_in_interpreter("kernel_interpreter_symmetric.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 17, proc.stdout
    for r in rows:
        tol = {"torch.float32": 1e-5, "torch.float16": 2e-3}.get(r["dtype"], 1e-2)
        assert r["written"], r
        assert r["symmetric"], r
        assert r["err"] < tol, r


def _widened(op, *tensors, **kwargs):
    """``op`` on fp32 copies of bf16 tensors, rounded once back: what a bf16 product on the CPU
    is (each product of two bf16 numbers is exact in fp32, the sums run in fp32)."""
    out = op(*(t.float() for t in tensors), **kwargs)
    return out.to(tensors[0].dtype)


def test_gram_cpu_falls_back_to_torch_exactly():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        X = torch.randn(3, 20, 30, dtype=dtype)
        C = torch.randn(3, 20, 20, dtype=dtype)
        y = gram(X)
        assert y.dtype == dtype and y.shape == (3, 20, 20)
        assert torch.equal(y, _widened(torch.bmm, X, X.mT))
        assert torch.equal(
            gram(X, alpha=0.5), _widened(torch.baddbmm, y, X, X.mT, beta=0.0, alpha=0.5)
        )
        assert torch.equal(
            gram(X, alpha=2.0, C=C, beta=-3.0),
            _widened(torch.baddbmm, C, X, X.mT, beta=-3.0, alpha=2.0),
        )
        X2, C2 = X[0], C[0]
        assert torch.equal(gram(X2), _widened(torch.mm, X2, X2.mT))
        assert torch.equal(
            gram(X2, alpha=2.0, C=C2, beta=-3.0),
            _widened(torch.addmm, C2, X2, X2.mT, beta=-3.0, alpha=2.0),
        )
        X4 = X.reshape(3, 1, 20, 30)
        assert torch.equal(gram(X4), y.reshape(3, 1, 20, 20))
        C3 = C.flip(1)
        assert torch.equal(
            baddbmm(C3, X, X.mT, beta=0.5, alpha=2.0),
            _widened(torch.baddbmm, C3, X, X.mT, beta=0.5, alpha=2.0),
        )


def test_no_half_precision_matmul_runs_on_the_cpu():
    """Every product of an orthogonalization on the CPU runs on fp32 operands (most CPUs
    emulate bf16 matmuls, about 16x slower than fp32), on the plain bf16 loop and on the fp16
    Gram-space path, while the input and the result stay bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from muon_plugin.orthogonalize import IterationPath, zeropower

    products = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm}
    seen: list[tuple[str, torch.dtype]] = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in products:
                seen.append((str(func), args[1].dtype))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    paths = (IterationPath(), IterationPath("gram", "fp16"))
    for shape, path in itertools.product(((2, 24, 40), (40, 24)), paths):
        with Products():
            out = zeropower(torch.randn(shape), path=path)
        assert out.dtype == torch.bfloat16 and out.shape == shape
    assert {name for name, _ in seen} >= {"aten.bmm.default", "aten.baddbmm.default"}, seen
    assert all(dtype == torch.float32 for _, dtype in seen), seen


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
    proc = run_test_script("kernel_import_without_triton.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "ok"


def test_gram_does_what_it_is_told():
    """kernel=False is torch whatever the shape; kernel=True is the kernel (no CUDA here)."""
    X = torch.randn(2, 16, 24)
    assert torch.equal(gram(X, kernel=False), torch.bmm(X, X.mT))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            gram(X, kernel=True)


def test_disable_env_var_forces_torch(monkeypatch):
    import muon_plugin.kernels.symmetric as S

    monkeypatch.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")
    assert not S.triton_kernels_enabled()


def test_the_kernels_region_scales_with_the_gpus_sm_count(monkeypatch):
    """Its tiles must fill the GPU it runs on (two programs per SM): a GPU of half the SMs
    takes the kernel with half the tiles; no GPU, the region measured on 132 SMs."""
    from muon_plugin.kernels import symmetric

    shape = (2048, 8192, 1)  # m, k, batch: 136 tiles, below 2 x 132 and above 2 x 66
    assert not use_symmetric_kernel(*shape)
    assert symmetric.sm_count(None) == symmetric.sm_count(torch.device("cpu")) == 132
    monkeypatch.setattr(symmetric, "sm_count", lambda device=None: 66)
    assert use_symmetric_kernel(*shape, device=torch.device("cuda", 0))
