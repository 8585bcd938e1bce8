"""Section ``kernels``: the Triton symmetric Gram kernel ``symmetric_matmul(X)`` against cuBLAS
``X @ X.mT`` (bf16), what the ``gram`` dispatcher picks and whether it is ever slower than
cuBLAS, and the epilogue form ``c * A @ A + b * A`` on the square Gram matrices."""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from bench import measure
from bench.config import Config, fmt_shape, scale_shape
from bench.measure import Timer, rel_err
from bench.reference import NS_COEFFS

KERNEL_SHAPES = [
    (4096, 4096),
    (4096, 14336),
    (1024, 4096),
    (32, 1024, 1024),
    (8, 2048, 2048),
    (128, 256, 256),
]


def symmetric_kernel():
    """(symmetric module, symmetric_matmul usable here?, why not)."""
    from muon_plugin.kernels import symmetric as S

    if not torch.cuda.is_available():
        return S, False, "no CUDA"
    if not S.triton_available():
        return S, False, "triton not importable"
    if os.environ.get("MUON_PLUGIN_DISABLE_TRITON", "0") == "1":
        return S, False, "MUON_PLUGIN_DISABLE_TRITON=1"
    return S, True, ""


@contextlib.contextmanager
def spy_symmetric(S) -> Iterator[list[int]]:
    """Count the calls ``gram`` makes to the Triton path (to see what it dispatched to)."""
    calls = [0]
    orig = S.symmetric_matmul

    def spy(*args, **kwargs):
        calls[0] += 1
        return orig(*args, **kwargs)

    S.symmetric_matmul = spy
    try:
        yield calls
    finally:
        S.symmetric_matmul = orig


def torch_product(X: torch.Tensor, alpha: float, C: torch.Tensor | None, beta: float):
    """The plain cuBLAS call: X @ X.mT, or addmm/baddbmm for the epilogue form."""
    if C is None:
        return X @ X.mT
    if X.dim() == 2:
        return torch.addmm(C, X, X.mT, beta=beta, alpha=alpha)
    return torch.baddbmm(C, X, X.mT, beta=beta, alpha=alpha)


def kernel_case(
    kind: str, shape: tuple[int, ...], X: torch.Tensor, timer: Timer, S, use_triton: bool
) -> dict:
    from muon_plugin.kernels import gram

    m, k = X.shape[-2:]
    batch = math.prod(X.shape[:-2])
    if kind == "gram":
        alpha, beta, C = 1.0, 0.0, None
        ref = X.float() @ X.float().mT
        flops = 2.0 * batch * m * m * k
    else:
        _, b, c = NS_COEFFS
        alpha, beta, C = c, b, X
        ref = alpha * (X.float() @ X.float().mT) + beta * X.float()
        flops = 2.0 * batch * m * m * k
    row: dict[str, Any] = {
        "section": "kernels",
        "kind": kind,
        "shape": fmt_shape(shape),
        "batch": batch,
        "m": m,
        "k": k,
    }
    row["cublas_ms"] = timer.bench(lambda: torch_product(X, alpha, C, beta))
    row["cublas_tflops"] = flops / row["cublas_ms"] * 1e-9
    with spy_symmetric(S) as calls:
        out = gram(X, alpha=alpha, C=C, beta=beta)
    row["dispatch"] = "triton" if calls[0] else "torch"
    row["gram_err"] = rel_err(out, ref)
    row["gram_ms"] = timer.bench(lambda: gram(X, alpha=alpha, C=C, beta=beta))
    if use_triton:
        out = S.symmetric_matmul(X, alpha=alpha, C=C, beta=beta)
        row["triton_err"] = rel_err(out, ref)
        row["triton_symmetric"] = bool(torch.equal(out, out.mT))
        row["triton_ms"] = timer.bench(lambda: S.symmetric_matmul(X, alpha=alpha, C=C, beta=beta))
        row["triton_tflops_equiv"] = flops / row["triton_ms"] * 1e-9
        row["speedup_triton"] = row["cublas_ms"] / row["triton_ms"]
        row["faster"] = "triton" if row["triton_ms"] < row["cublas_ms"] else "torch"
        row["dispatch_right"] = row["dispatch"] == row["faster"]
    else:
        row["triton_ms"] = None
        row["faster"] = None
        row["dispatch_right"] = None
    # The rule that matters: dispatching must never cost more than plain cuBLAS, the Python
    # of the dispatch included (allowance: 5% or 2 us of timer noise, whichever is larger).
    row["gram_vs_cublas"] = row["gram_ms"] / row["cublas_ms"]
    row["dispatch_ok"] = row["gram_ms"] <= max(1.05 * row["cublas_ms"], row["cublas_ms"] + 0.002)
    return row


def section_kernels(cfg: Config, device: torch.device, timer: Timer, log) -> list[dict]:
    S, use_triton, why = symmetric_kernel()
    if device.type != "cuda":
        use_triton, why = False, "no CUDA"
    if not use_triton:
        log(f"  (Triton symmetric kernel skipped: {why}; timing torch and the dispatcher only)")
    rows = []
    shapes = [scale_shape(s, cfg.div) for s in KERNEL_SHAPES]
    square: list[tuple[int, ...]] = []
    for shape in shapes:
        sq = (*shape[:-1], shape[-2])
        if sq not in square:
            square.append(sq)
    gen = torch.Generator(device=device).manual_seed(0)
    cases = [("gram", s) for s in shapes] + [("epilogue", s) for s in square]
    for kind, shape in cases:
        try:
            X = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
            X = (X / math.sqrt(shape[-1])).to(torch.bfloat16)  # X X^T has O(1) entries
            if kind == "epilogue":
                A = X.float() @ X.float().mT
                X = ((A + A.mT) * 0.5).to(torch.bfloat16)  # exactly symmetric
            row = kernel_case(kind, shape, X, timer, S, use_triton)
            if not use_triton:
                row["note"] = f"triton kernel skipped: {why}"
        except Exception as e:
            row = {"section": "kernels", "kind": kind, "shape": fmt_shape(shape), "error": repr(e)}
            traceback.print_exc()
        rows.append(row)
        log("  " + kernel_line(row))
        measure.free_memory()
    return rows


def kernel_line(r: dict) -> str:
    if "error" in r:
        return f"{r['kind']:>8} {r['shape']:>14}  ERROR {r['error'][:90]}"
    tri = f"{r['triton_ms']:8.4f}" if r.get("triton_ms") is not None else f"{'n/a':>8}"
    right = {True: "yes", False: "NO", None: "-"}[r.get("dispatch_right")]
    return (
        f"{r['kind']:>8} {r['shape']:>14} cuBLAS {r['cublas_ms']:8.4f}  triton {tri}  "
        f"gram {r['gram_ms']:8.4f} -> {r['dispatch']:<6} faster-choice:{right:>3}  "
        f"never-slower:{'yes' if r['dispatch_ok'] else 'NO'}"
    )
