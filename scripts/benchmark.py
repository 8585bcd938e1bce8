#!/usr/bin/env python
"""Benchmark muon_plugin: symmetric kernels, the orthogonalization loop, optimizer.step(), memory.

One run, one process (``--repeats N``: N runs, each in its own process, every figure reported
as the median of the runs with their range; ``--merge A.json B.json ...``: the same report from
runs saved earlier with ``--json``). Sections (``--sections``, default all):

1. ``kernels``: the Triton symmetric Gram kernel ``symmetric_matmul(X)`` against cuBLAS
   ``X @ X.mT`` (bf16), what the ``gram`` dispatcher picks and whether it is ever slower than
   cuBLAS, and the epilogue form ``c * A @ A + b * A`` on the square Gram matrices.
2. ``ortho``: ``zeropower`` per strategy (polar_express, newton_schulz; 5 steps), ms and achieved
   TFLOP/s (plain-matmul count: ``4 m^2 n + 2 m^3`` per step, m <= n) against a bf16 matmul
   peak measured in the same run; accuracy: relative distance to the fp64 iteration and to the
   exact polar factor (fp64) on a Gaussian and on a low-rank-plus-noise input, each path
   checked against the plain bf16 loop (never farther from the polar factor).
3. ``step``: ``optimizer.step()`` on a 4-layer Llama-3-8B slice (28 matrices, 0.87 B params) and
   a GPT-125M (72 matrices), fp32 params and grads: ours (MuonForeach, with NorMuon's row
   normalization too, Muon, MuonLP int8 and int4 at default settings, compiled), torch's Muon,
   a naive per-parameter reference Muon, fused AdamW, the elementwise part of our step alone,
   and any importable peer at its fastest documented settings (dion's Muon with gram
   Newton-Schulz or its Triton kernels, inside its CUDA-graph wrapper; gram-newton-schulz's
   Muon; muonium; dtensor_muon); then the Llama slice
   with bf16 params and grads (what FSDP's mixed precision with bf16 parameters hands over)
   for a few of those rows.
4. ``memory``: optimizer-state bytes (per parameter) and the peak memory above params and grads
   over building the optimizer and all its steps (CUDA-graph pools included), also in units of
   the state; the transient peak of one steady step and of the first step; what stays
   allocated between steps besides the state (CUDA-graph pools; static inputs, library
   workspaces and other allocations).

On a CUDA GPU the full sizes are used (``--quick``: small ones); on the CPU small shapes (matrix
dims / 16, fewer layers) so the whole run takes well under a minute, and the Triton-only columns
are skipped. Timing: ``triton.testing.do_bench`` medians (CUDA events when triton is missing),
``optimizer.step()`` timed step by step with CUDA events after warm-up (median);
``time.perf_counter`` medians on the CPU.

    python scripts/benchmark.py [--quick] [--sections kernels,ortho,step,memory]
        [--results RESULTS.md] [--json rows.json] [--device auto|cpu|cuda] [--repeats N]
        [--rows WORD,WORD] [--workloads llama,gpt,llama-bf16] [--budget SECONDS]
    python scripts/benchmark.py --merge run1.json run2.json run3.json [--results RESULTS.md]

Prints its tables; only with ``--results PATH`` does it write them, into its own section of
that file (between ``<!-- benchmark:start -->`` and ``<!-- benchmark:end -->``), keeping
everything else in the file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import muon_plugin  # noqa: E402
from muon_plugin import Muon, MuonForeach, zeropower  # noqa: E402
from muon_plugin.orthogonalize import coefficient_schedule, use_gram_iteration  # noqa: E402

SECTIONS = ("kernels", "ortho", "step", "memory")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for results_md
from results_md import markers, replace_section  # noqa: E402

MARK_START, MARK_END = markers("benchmark")
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (a, b, c)
LR, WD = 1e-3, 0.1

# Peer numbers measured on one H200 (shared/notes/anchors.md), for the summary of a full GPU run.
ANCHORS_MS = {
    "llama3-8b-4L": {
        "torch.optim.Muon (2.11)": 146.0,
        "naive per-parameter": 159.0,
        "fused AdamW": 7.2,
        "muonium newton_schulz": 126.0,
        "dion Muon, Triton (best)": 113.0,
    },
    "gpt-125m": {
        "torch.optim.Muon (2.11)": 37.1,
        "naive per-parameter": 51.6,
        "fused AdamW": 1.0,
        "muonium": 9.2,
        "dion Muon, torch NS (best)": 5.1,
    },
}


# ----------------------------------------------------------------------------- configuration


WORKLOADS = ("llama", "gpt", "llama-bf16")
"""The step section's workloads, as ``--workloads`` names them."""


@dataclass(frozen=True)
class Selection:
    """Which step rows and workloads run, and until when (``--rows``, ``--workloads``,
    ``--budget``): a run cut short by a time limit should still leave its rows."""

    rows: tuple[str, ...] = ()
    """Lower-case substrings of row names; a row runs if its name contains one (empty: all)."""
    workloads: tuple[str, ...] = WORKLOADS
    deadline: float | None = None
    """``time.perf_counter()`` after which no new row starts (its row is marked skipped)."""

    def takes(self, row_name: str) -> bool:
        return not self.rows or any(p in row_name.lower() for p in self.rows)

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


@dataclass(frozen=True)
class Config:
    """Sizes and repetition counts of one run."""

    full: bool  # the real sizes (GPU, not --quick)
    div: int  # matrix dims are divided by this
    llama_layers: int
    gpt_layers: int
    peak_n: int  # n of the n^3 bf16 matmul that measures the peak
    step_warmup: int
    step_iters_large: int  # timed steps, Llama workload
    step_iters_small: int  # timed steps, GPT workload
    compile_row: bool
    select: Selection = Selection()


def make_config(cuda: bool, quick: bool, compile_flag: bool | None) -> Config:
    if cuda and not quick:
        return Config(True, 1, 4, 12, 8192, 3, 8, 20, compile_flag is not False)
    if quick:  # the CI smoke test: every row, as little work as possible
        return Config(False, 16, 1, 3, 512, 1, 3, 3, bool(compile_flag))
    return Config(False, 16, 2, 6, 512, 1, 5, 5, bool(compile_flag))


def scale_shape(shape: tuple[int, ...], div: int) -> tuple[int, ...]:
    """Divide the two matrix dims by ``div`` (batch dims are kept)."""
    return (*shape[:-2], max(1, shape[-2] // div), max(1, shape[-1] // div))


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median time of a callable: do_bench / CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.do_bench = None
        if self.cuda:
            try:
                import triton.testing

                self.do_bench = triton.testing.do_bench
            except Exception:
                self.do_bench = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def bench(self, fn: Callable[[], Any], *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
        """Median ms of ``fn()``; the first call (autotuning, compilation) is excluded."""
        fn()
        self.sync()
        if self.do_bench is not None:
            return float(self.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        if self.cuda:
            times = []
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            deadline = time.perf_counter() + rep_ms / 1e3
            while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            return statistics.median(times)
        times = []
        deadline = time.perf_counter() + min(rep_ms, 60) / 1e3
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def time_step(self, step: Callable[[], Any]) -> float:
        """One call of ``step`` in isolation (GPU idle before), in ms."""
        if self.cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    def wall(self, step: Callable[[], Any]) -> float:
        """Wall-clock ms of ``step`` including the device catching up (first steps)."""
        self.sync()
        t0 = time.perf_counter()
        step()
        self.sync()
        return (time.perf_counter() - t0) * 1e3


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- section 1: kernels

KERNEL_SHAPES = [
    (4096, 4096),
    (4096, 14336),
    (1024, 4096),
    (32, 1024, 1024),
    (8, 2048, 2048),
    (128, 256, 256),
]


def _kernel_module():
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
    S, use_triton, why = _kernel_module()
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
        free_memory()
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


# ----------------------------------------------------------------------------- section 2: ortho

ORTHO_SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336), (8, 1024, 1024)]


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """Plain-matmul FLOPs of ``steps`` iterations on a (batch of) m x n matrix."""
    batch = math.prod(shape[:-2])
    m, n = sorted(shape[-2:])
    return batch * steps * (4.0 * m * m * n + 2.0 * m**3)


def measure_peak(cfg: Config, device: torch.device, timer: Timer) -> dict:
    n = cfg.peak_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = timer.bench(lambda: torch.mm(a, b))
    return {
        "section": "peak",
        "name": f"bf16 matmul {n}^3",
        "ms": ms,
        "tflops": 2.0 * n**3 / ms * 1e-9,
    }


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class Patched:
    """What a row's patch replaced, and how often the replacement was called: a row whose
    patch is never called would time the unpatched code under the ablation's name.

    A row's ``context`` yields one (checked after the row's steps) or None (nothing to check,
    e.g. an environment switch). ``on_cpu=False``: the patched code runs only on a GPU (the
    CPU takes the torch paths without asking it), so a CPU run does not check it.
    """

    def __init__(self, what: str, on_cpu: bool = True):
        self.what = what
        self.on_cpu = on_cpu
        self.calls = 0

    def counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, counting its calls."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return fn(*args, **kwargs)

        return counted

    def verify(self, cuda: bool) -> None:
        """Raise when the replacement was never called where it should have been."""
        if self.calls == 0 and (cuda or self.on_cpu):
            raise RuntimeError(f"the row's patch of {self.what} was never called")


@contextlib.contextmanager
def row_patch(
    target: Any, attribute: str, replacement: Callable[..., Any], on_cpu: bool = True
) -> Iterator[Patched]:
    """``target.attribute`` replaced by ``replacement`` (its calls counted) while the context
    is active; yields the :class:`Patched`."""
    patched = Patched(f"{getattr(target, '__name__', target)}.{attribute}", on_cpu)
    with mock.patch.object(target, attribute, patched.counting(replacement)):
        yield patched


def cublas_below_m(min_m: int) -> contextlib.AbstractContextManager[Patched]:
    """The plans built inside leave every product with m < ``min_m`` to cuBLAS, CUDA-graphed
    or not (an ablation of the kernel's wider region inside graphs)."""
    from muon_plugin.orthogonalize import paths

    rule = paths.kernel_wins
    return row_patch(
        paths,
        "kernel_wins",
        lambda m, k, batch=1, graphed=False, device=None: (
            m >= min_m and rule(m, k, batch, device=device)
        ),
        on_cpu=False,  # asked only where the Triton kernel could run
    )


def torch_matrix_scaling() -> contextlib.AbstractContextManager[Patched]:
    """The per-matrix scalings of the orthogonalization (pre-scaling, folded norms) as torch
    ops instead of the Triton kernel (an ablation; the same results)."""
    from muon_plugin.kernels import matrix_scale

    return row_patch(matrix_scale, "_use_kernel", lambda X, kernel: False)


def ortho_variants(G: torch.Tensor, use_triton: bool) -> list[tuple[str, Callable, dict, str]]:
    """(name, fn of the input, environment, the fp64 loop it computes) for one input shape:
    the default path, Newton-Schulz, the plain bf16 loop, the default path on cuBLAS alone
    (where the Gram-space path runs, which is cuBLAS-only otherwise), the naive reference."""
    variants: list[tuple[str, Callable[[torch.Tensor], Any], dict, str]] = [
        ("polar_express", lambda X: zeropower(X, 5, "polar_express"), {}, "polar_express"),
        ("newton_schulz", lambda X: zeropower(X, 5, "newton_schulz"), {}, "newton_schulz"),
    ]
    variants.append(
        (
            PLAIN_LOOP,
            lambda X: zeropower(X, 5, "polar_express", gram_space=False),
            {"MUON_PLUGIN_DISABLE_TRITON": "1"},
            "polar_express",
        )
    )
    if use_triton and use_gram_iteration(G.reshape(-1, *G.shape[-2:]).to(torch.bfloat16)):
        variants.append(
            (
                "polar_express, cuBLAS only",
                lambda X: zeropower(X, 5, "polar_express"),
                {"MUON_PLUGIN_DISABLE_TRITON": "1"},
                "polar_express",
            )
        )
    variants.append(
        ("naive eager NS (reference)", lambda X: naive_newton_schulz(X, 5), {}, "newton_schulz")
    )
    return variants


PLAIN_LOOP = "polar_express, plain bf16 loop"
"""The plain bf16 loop (no Gram space, cuBLAS only): the accuracy every fast path must keep."""


def low_rank_plus_noise(shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """A gradient-like input: rank min(m, n) / 32 with decaying singular values, plus 1% noise."""
    *batch, m, n = shape
    r = max(1, min(m, n) // 32)
    U = torch.randn(*batch, m, r, device=device, generator=gen)
    V = torch.randn(*batch, r, n, device=device, generator=gen)
    decay = torch.logspace(0, -2, r, device=device).view(*([1] * len(batch)), 1, r)
    low = (U * decay) @ V
    noise = torch.randn(shape, device=device, generator=gen)
    return low / low.norm() + 0.01 * noise / noise.norm()


def exact_polar(G: torch.Tensor) -> torch.Tensor:
    """The polar factor U V^T of G (thin SVD), in fp64 through the eigendecomposition of the
    smaller Gram matrix: (G G^T)^(-1/2) G."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    lam, V = torch.linalg.eigh(X @ X.mT)
    inv_sqrt = lam.clamp_min(lam.amax(-1, keepdim=True) * 1e-24).rsqrt()
    P = (V * inv_sqrt.unsqueeze(-2)) @ V.mT @ X
    return P.mT if tall else P


def section_ortho(cfg: Config, device: torch.device, timer: Timer, peak: dict, log) -> list[dict]:
    S, use_triton, _ = _kernel_module()
    use_triton = use_triton and device.type == "cuda"
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for shape in (scale_shape(s, cfg.div) for s in ORTHO_SHAPES):
        G = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)  # fp32, as
        flops = ns_flops(shape)  # the optimizer hands over momentum directions
        refs = {s: float64_loop(G, s) for s in ("polar_express", "newton_schulz")}
        L = low_rank_plus_noise(shape, gen, device)
        polar = {"gauss": exact_polar(G), "low_rank": exact_polar(L)}
        for name, fn, env, loop in ortho_variants(G, use_triton):
            row: dict[str, Any] = {"section": "ortho", "shape": fmt_shape(shape), "name": name}
            try:
                with contextlib.ExitStack() as stack:
                    for k, v in env.items():
                        stack.enter_context(env_var(k, v))
                    ms = timer.bench(lambda fn=fn, G=G: fn(G))
                    row["err_fp64"] = rel_err(fn(G), refs[loop])
                    row["polar_err_gauss"] = rel_err(fn(G), polar["gauss"])
                    row["polar_err_low_rank"] = rel_err(fn(L), polar["low_rank"])
                row.update(ms=ms, tflops=flops / ms * 1e-9, flops=flops)
                row["pct_peak"] = 100.0 * row["tflops"] / peak["tflops"]
                row["floor_ms"] = flops / (peak["tflops"] * 1e9)
            except Exception as e:
                row["error"] = repr(e)
                traceback.print_exc()
            rows.append(row)
            log("  " + ortho_line(row))
        check_accuracy(rows, fmt_shape(shape), log)
        del G, L, refs, polar
        free_memory()
    return rows


def check_accuracy(rows: list[dict], shape: str, log) -> None:
    """Mark each polar_express row whose distance to the exact polar factor exceeds the plain
    bf16 loop's (by more than 1%, the spread of bf16 rounding between runs)."""
    mine = [r for r in rows if r["shape"] == shape and "error" not in r]
    plain = next((r for r in mine if r["name"] == PLAIN_LOOP), None)
    if plain is None:
        return
    for r in mine:
        if not r["name"].startswith("polar_express"):
            continue
        r["as_accurate_as_plain"] = all(
            r[k] <= plain[k] * 1.01 for k in ("polar_err_gauss", "polar_err_low_rank")
        )
        if not r["as_accurate_as_plain"]:
            log(f"  ! {shape} {r['name']}: farther from the exact polar factor than the plain loop")


def float64_loop(G: torch.Tensor, strategy: str, steps: int = 5) -> torch.Tensor:
    """The intended map, run in fp64: normalize, then the strategy's steps (tall: transposed)."""
    sched = coefficient_schedule(strategy, steps)
    X = G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * sched.norm_safety)
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    for a, b, c in sched.coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def ortho_line(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:>14} {r['name']:<28} ERROR {r['error'][:90]}"
    return (
        f"{r['shape']:>14} {r['name']:<28} {r['ms']:9.3f} ms  {tf(r['tflops']):>7} TFLOP/s  "
        f"{r['pct_peak']:5.1f}% of peak (floor {r['floor_ms']:.3f} ms)  "
        f"err vs fp64 loop {r.get('err_fp64', float('nan')):.2e}  vs exact polar: gauss "
        f"{r.get('polar_err_gauss', float('nan')):.4f}, low rank "
        f"{r.get('polar_err_low_rank', float('nan')):.4f}"
    )


# ----------------------------------------------------------------------------- reference Muon


def naive_newton_schulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Eager bf16 quintic Newton-Schulz, the way Muon's reference code writes it."""
    a, b, c = NS_COEFFS
    X = G.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X


class NaiveMuon(torch.optim.Optimizer):
    """Per-parameter reference Muon: momentum + Nesterov, eager NS, decoupled weight decay."""

    def __init__(self, params, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True, ns_steps=5):
        super().__init__(
            params,
            dict(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
            ),
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                direction = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = naive_newton_schulz(direction, group["ns_steps"])
                scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)


# ----------------------------------------------------------------------------- section 3/4: step


def llama_shapes(layers: int, div: int) -> list[tuple[str, tuple[int, int]]]:
    per_layer = [
        ("wq", (4096, 4096)),
        ("wk", (1024, 4096)),
        ("wv", (1024, 4096)),
        ("wo", (4096, 4096)),
        ("w1", (14336, 4096)),
        ("w3", (14336, 4096)),
        ("w2", (4096, 14336)),
    ]
    return [(f"layers.{i}.{n}", scale_shape(s, div)) for i in range(layers) for n, s in per_layer]


def gpt_shapes(layers: int, div: int) -> list[tuple[str, tuple[int, int]]]:
    d = 768
    per_layer = [
        ("q", (d, d)),
        ("k", (d, d)),
        ("v", (d, d)),
        ("o", (d, d)),
        ("fc", (4 * d, d)),
        ("proj", (d, 4 * d)),
    ]
    return [(f"h.{i}.{n}", scale_shape(s, div)) for i in range(layers) for n, s in per_layer]


@dataclass
class Workload:
    name: str
    params: list[torch.nn.Parameter]
    iters: int

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def flops(self) -> float:
        return sum(ns_flops(tuple(p.shape)) for p in self.params)


def make_workload(
    name: str, shapes, device: torch.device, iters: int, dtype: torch.dtype = torch.float32
) -> Workload:
    gen = torch.Generator(device=device).manual_seed(2)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, device=device, generator=gen) * 0.02).to(dtype))
        p.grad = torch.randn(shape, device=device, generator=gen).to(dtype)
        params.append(p)
    return Workload(name, params, iters)


BF16_ROWS = (
    "MuonForeach (polar_express)",
    "MuonForeach (NorMuon)",
    "MuonLP (int8)",
    "torch.optim.Muon",
    "AdamW(fused=True)",
    "MuonForeach elementwise only",
)
"""The rows timed on the bf16 workload (bf16 params and grads, as FSDP's mixed precision with
bf16 parameters hands them over)."""


def identity_orthogonalization() -> contextlib.AbstractContextManager[Patched]:
    """Replace the plan's orthogonalization by a bf16 cast: what is left is the elementwise step."""
    from muon_plugin.distributed import plan as plan_mod

    def run(self, directions, phase=None):
        return [None if d is None else d.to(torch.bfloat16) for d in directions]

    return row_patch(plan_mod.OrthogonalizationPlan, "run", run)


@dataclass
class Row:
    name: str
    group: str  # "ours", "torch", "reference", "peer", "elementwise"
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None
    context: Callable[[], contextlib.AbstractContextManager[Patched | None]] | None = None
    """Entered around the row (building the optimizer and every step); the :class:`Patched`
    it yields, if any, is verified after the steps."""
    skip: str | None = None
    required: bool = False  # an error here makes the script exit non-zero


def _dion_graphed(ps: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """dion's Muon inside its CUDA-graph wrapper: two eager steps, then capture and replay."""
    from dion import Muon as DionMuon
    from dion.cuda_graph import CudaGraphOptimizer

    return CudaGraphOptimizer(DionMuon(ps, lr=LR, weight_decay=WD, **kwargs), warmup_steps=2)


def _gram_newton_schulz_muon(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from gram_newton_schulz import Muon as GramMuon

    return GramMuon(ps, lr=LR, weight_decay=WD)


PEERS: list[tuple[str, tuple[str, ...], Callable[[list[torch.nn.Parameter]], Any]]] = [
    (
        "dion Muon (gram NS, CUDA graph)",
        ("dion", "gram_newton_schulz"),
        lambda ps: _dion_graphed(ps, use_gram_newton_schulz=True),
    ),
    ("dion Muon (Triton, CUDA graph)", ("dion",), lambda ps: _dion_graphed(ps, use_triton=True)),
    ("gram_newton_schulz.Muon", ("gram_newton_schulz",), _gram_newton_schulz_muon),
]
"""Peers on a GPU at their fastest documented settings: (row, modules it needs, factory)."""

GENERIC_PEERS = [("muonium", ["Muon", "MuonForeach"]), ("dtensor_muon", ["Muon", "MuonForeach"])]
"""Peers whose classes take ``(params, lr=...)`` and run anywhere."""


def _missing(modules: tuple[str, ...]) -> str | None:
    """Why one of ``modules`` cannot be imported, or None when all can."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            return f"{module} not importable ({type(e).__name__})"
    return None


def peer_rows() -> list[Row]:
    rows = []
    for name, modules, make in PEERS:
        why = _missing(modules)
        if why is None and not torch.cuda.is_available():
            why = "needs a GPU"
        rows.append(Row(name, "peer", None if why else make, skip=why))
    for module, classes in GENERIC_PEERS:
        why = _missing((module,))
        mod = None if why else importlib.import_module(module)
        found = [c for c in classes if mod is not None and hasattr(mod, c)]
        if why is None and not found:
            why = f"no class among {classes}"
        if why:
            rows.append(Row(f"{module}.Muon", "peer", None, skip=why))
        for cls_name in found:
            cls = getattr(mod, cls_name)
            rows.append(Row(f"{module}.{cls_name}", "peer", lambda ps, cls=cls: cls(ps, lr=LR)))
    return rows


def lp_rows() -> list[Row]:
    """MuonLP at its default settings per momentum format (skipped without torchao)."""
    try:
        from muon_plugin.lp import MuonLP, require_torchao

        require_torchao("int8")
    except Exception as e:
        why = f"MuonLP not importable ({type(e).__name__})"
        return [Row(f"MuonLP ({d})", "ours", None, skip=why) for d in ("int8", "int4")]
    return [
        Row(f"MuonLP ({d})", "ours", lambda ps, d=d: MuonLP(ps, lr=LR, wd=WD, state_dtype=d))
        for d in ("int8", "int4")
    ]


def optimizer_rows(cfg: Config) -> list[Row]:
    compile_skip = "--no-compile" if cfg.full else "skipped on small runs (use --compile)"
    rows = [
        Row(
            "MuonForeach (polar_express)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            required=True,
        ),
        Row(
            "MuonForeach (newton_schulz)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, orthogonalization_strategy="newton_schulz"),
            required=True,
        ),
        Row(  # NorMuon: the same step plus the per-row normalization (its speed budget: +3%)
            "MuonForeach (NorMuon)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, normalization="normuon"),
            required=True,
        ),
        Row("Muon (per-parameter)", "ours", lambda ps: Muon(ps, lr=LR, wd=WD), required=True),
        *lp_rows(),
        Row(
            "MuonForeach, no Gram space",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, backend="auto:no-gram"),
        ),
        Row(  # the "eager" backend: what a run short of memory chooses
            "MuonForeach, no CUDA graphs",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, backend="eager"),
            skip=None if torch.cuda.is_available() else "CUDA graphs need a GPU",
        ),
        Row(
            "MuonForeach, cuBLAS below m = 1024",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            context=lambda: cublas_below_m(1024),
            skip=None if torch.cuda.is_available() else "the Triton kernel needs a GPU",
        ),
        Row(
            "MuonForeach, torch per-matrix scaling",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            context=torch_matrix_scaling,
            skip=None if torch.cuda.is_available() else "the Triton kernel needs a GPU",
        ),
        Row(
            "MuonForeach(compile=True)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, compile=True),
            skip=None if cfg.compile_row else compile_skip,
        ),
    ]
    if hasattr(torch.optim, "Muon"):
        rows.append(
            Row(
                "torch.optim.Muon", "torch", lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=WD)
            )
        )
    else:
        rows.append(Row("torch.optim.Muon", "torch", None, skip="not in this torch"))
    rows.append(Row("naive reference Muon", "reference", lambda ps: NaiveMuon(ps)))

    def adamw(ps):
        try:
            return torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True)
        except (RuntimeError, ValueError):
            return torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=True)

    rows.append(Row("AdamW(fused=True)", "torch", adamw))
    rows.append(
        Row(
            "MuonForeach elementwise only",
            "elementwise",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            context=identity_orthogonalization,
            required=True,
        )
    )
    rows += peer_rows()
    return rows


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state``; views of one storage count that storage once."""
    storages: dict[int, int] = {}

    def walk(v):
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            storages[st.data_ptr() or id(v)] = st.nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for st in opt.state.values():
        walk(st)
    return sum(storages.values())


def pool_bytes(snapshot: list[dict]) -> dict[str, int]:
    """Bytes reserved in a ``torch.cuda.memory_snapshot()``: by the default pool, and by the
    private pools of CUDA graphs."""
    out = {"default": 0, "graphs": 0}
    for segment in snapshot:
        private = tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        out["graphs" if private else "default"] += segment["total_size"]
    return out


class MemoryProbe:
    """CUDA memory above a base: per-window peaks and the peak over a row's whole life.

    The lifetime figure is what a training job must budget beside its params and grads: the
    highest allocation while the optimizer is built and stepped, or, when larger, the memory
    still reserved once the cache is emptied (CUDA-graph pools hold their memory between
    replays without counting it as allocated).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.high = 0
        if cuda:
            free_memory()
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            self.base_reserved = torch.cuda.memory_reserved()
            self.base_pools = pool_bytes(torch.cuda.memory_snapshot())
            self.window_base = self.base
            torch.cuda.reset_peak_memory_stats()

    def kept_mib(self, state: int) -> tuple[float, float]:
        """Where the memory kept between steps goes, in MiB above the base: (allocated beyond
        the optimizer state ``state`` bytes: static graph inputs, library workspaces, cached
        tables; reserved by CUDA-graph pools, which keep their steps' temporaries)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graphs = pool_bytes(torch.cuda.memory_snapshot())["graphs"] - self.base_pools["graphs"]
        other = torch.cuda.memory_allocated() - self.base - state
        return other / 2**20, graphs / 2**20

    def start(self) -> None:
        """Open a window: its peak is measured above what is allocated now."""
        if self.cuda:
            self._fold()
            self.window_base = torch.cuda.memory_allocated()

    def window_mib(self) -> float:
        """Peak MiB of the current window above its start."""
        return (self._fold() - self.window_base) / 2**20

    def lifetime_mib(self) -> tuple[float, float]:
        """(peak MiB above the base over the whole life, MiB still reserved above it)."""
        self._fold()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved() - self.base_reserved
        return max(self.high - self.base, held) / 2**20, held / 2**20

    def _fold(self) -> int:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.high = max(self.high, peak)
        torch.cuda.reset_peak_memory_stats()
        return peak


def _steps(out: dict, opt: torch.optim.Optimizer, wl: Workload, cfg: Config, timer: Timer,
           probe: MemoryProbe, timed: bool, mem: bool) -> None:  # fmt: skip
    """Step ``opt``: first step, warm-up, timed steps, one probed steady step; fills ``out``."""
    probe.start()
    out["first_step_ms"] = timer.wall(opt.step)
    if timer.cuda:
        out["first_step_peak_mib"] = probe.window_mib()
    for _ in range(cfg.step_warmup - 1):
        opt.step()
    timer.sync()
    if timed:
        times = [timer.time_step(opt.step) for _ in range(wl.iters)]
        out["ms"] = statistics.median(times)
        out["min_ms"] = min(times)
        out["iters"] = len(times)
    if mem or timed:
        sb = state_bytes(opt)
        out["state_mib"] = sb / 2**20
        out["state_bytes_per_param"] = sb / wl.n_params
    if mem and timer.cuda:
        probe.start()
        opt.step()
        out["step_peak_mib"] = probe.window_mib()
        out["kept_mib"], out["graph_pools_mib"] = probe.kept_mib(state_bytes(opt))
        out["peak_mib"], out["held_mib"] = probe.lifetime_mib()


def run_row(row: Row, wl: Workload, cfg: Config, timer: Timer, timed: bool, mem: bool) -> dict:
    out: dict[str, Any] = {"workload": wl.name, "name": row.name, "group": row.group}
    if row.skip:
        out["skipped"] = row.skip
        return out
    opt = None
    try:
        with contextlib.ExitStack() as stack:
            patched = stack.enter_context(row.context()) if row.context else None
            if patched is not None and not isinstance(patched, Patched):
                raise TypeError(f"the row's context yields {type(patched).__name__}, not Patched")
            probe = MemoryProbe(timer.cuda)
            opt = row.make(wl.params)
            _steps(out, opt, wl, cfg, timer, probe, timed, mem)
            if patched is not None:
                patched.verify(timer.cuda)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        if row.group != "peer":
            traceback.print_exc()
    finally:
        del opt
        free_memory()
    return out


def add_ratios(rows: list[dict]) -> None:
    by = {r["name"]: r for r in rows}
    ref_torch = by.get("torch.optim.Muon", {}).get("ms")
    ref_naive = by.get("naive reference Muon", {}).get("ms")
    adamw = by.get("AdamW(fused=True)", {}).get("ms")
    for r in rows:
        if r.get("ms") is None:
            continue
        r["speedup_vs_torch"] = ref_torch / r["ms"] if ref_torch else None
        r["speedup_vs_naive"] = ref_naive / r["ms"] if ref_naive else None
        if r["name"] == "MuonForeach elementwise only" and adamw:
            r["vs_fused_adamw"] = r["ms"] / adamw
            r["within_2x_adamw"] = r["ms"] <= 2.0 * adamw


def workload_entries(rows: list[dict], timed: bool, mem: bool) -> tuple[list[dict], list[dict]]:
    """The step and memory section entries of one workload's rows (their ratios added, or
    updated when more rows came since)."""
    add_ratios(rows)
    step_rows: list[dict] = []
    mem_rows: list[dict] = []
    for r in rows:
        base = {k: r[k] for k in ("workload", "name", "group") if k in r}
        if timed:
            step_rows.append({"section": "step", **r})
        if mem:
            m = {"section": "memory", **base}
            for k in (
                "state_mib",
                "state_bytes_per_param",
                "peak_mib",
                "held_mib",
                "step_peak_mib",
                "first_step_peak_mib",
                "kept_mib",
                "graph_pools_mib",
                "skipped",
                "error",
                "required",
            ):
                if k in r:
                    m[k] = r[k]
            mem_rows.append(m)
    return step_rows, mem_rows


def section_step(
    cfg: Config,
    device: torch.device,
    timer: Timer,
    peak: dict | None,
    timed: bool,
    mem: bool,
    log,
    saved: Callable[[list[dict], list[dict]], None] = lambda step, mem: None,
) -> tuple[list[dict], list[dict]]:
    """Every selected row on every selected workload; ``saved(step_rows, mem_rows)`` after
    each row with everything measured so far (``--json`` keeps a partial file)."""
    if cfg.compile_row:
        with contextlib.suppress(Exception):
            from torch._dynamo import config as dynamo_config

            for attr in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo_config, attr):
                    setattr(dynamo_config, attr, max(64, getattr(dynamo_config, attr)))
    llama = "llama3-8b-4L" if cfg.full else f"llama3-8b-{cfg.llama_layers}L/{cfg.div}"
    llama_mats = llama_shapes(cfg.llama_layers, cfg.div)
    specs = [
        ("llama", llama, llama_mats, cfg.step_iters_large, torch.float32),
        (
            "gpt",
            "gpt-125m" if cfg.full else f"gpt-125m-{cfg.gpt_layers}L/{cfg.div}",
            gpt_shapes(cfg.gpt_layers, cfg.div),
            cfg.step_iters_small,
            torch.float32,
        ),
        ("llama-bf16", f"{llama} bf16", llama_mats, cfg.step_iters_large, torch.bfloat16),
    ]
    step_rows: list[dict] = []
    mem_rows: list[dict] = []
    for key, wl_name, shapes, iters, dtype in specs:
        if key not in cfg.select.workloads:
            continue
        wl = make_workload(wl_name, shapes, device, iters, dtype)
        floor = (wl.flops / (peak["tflops"] * 1e9)) if peak else None
        log(
            f"  workload {wl.name}: {len(wl.params)} matrices, {wl.n_params / 1e6:.1f} M params, "
            f"{wl.flops / 1e12:.3f} TFLOP per Muon step"
            + (f", plain-matmul floor {floor:.2f} ms" if floor else "")
        )
        rows: list[dict] = []
        done_step: list[dict] = []
        done_mem: list[dict] = []
        for row in optimizer_rows(cfg):
            if (dtype != torch.float32 and row.name not in BF16_ROWS) or not cfg.select.takes(
                row.name
            ):
                continue
            if cfg.select.expired():
                row = Row(row.name, row.group, None, skip="time budget (--budget) spent")
            r = run_row(row, wl, cfg, timer, timed, mem)
            r["required"] = row.required
            r["n_params"] = wl.n_params
            r["n_matrices"] = len(wl.params)
            r["floor_ms"] = floor
            rows.append(r)
            log("    " + step_line(r))
            done_step, done_mem = workload_entries(rows, timed, mem)
            saved(step_rows + done_step, mem_rows + done_mem)
        step_rows += done_step
        mem_rows += done_mem
        del wl
        free_memory()
    return step_rows, mem_rows


def step_line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['name']:<30} skipped: {r['skipped']}"
    if "error" in r:
        return f"{r['name']:<30} ERROR {r['error'][:100]}"
    parts = [f"{r['name']:<30}"]
    if "ms" in r:
        parts.append(f"{r['ms']:9.3f} ms (min {r['min_ms']:.3f})")
    parts.append(f"first step {r['first_step_ms']:9.1f} ms")
    if "state_bytes_per_param" in r:
        parts.append(f"state {r['state_bytes_per_param']:.2f} B/param")
    if "peak_mib" in r:
        parts.append(f"peak +{r['peak_mib']:.0f} MiB")
    if "graph_pools_mib" in r:
        parts.append(f"kept: graph pools {r['graph_pools_mib']:.0f}, other {r['kept_mib']:.0f} MiB")
    return "  ".join(parts)


# ----------------------------------------------------------------------------- reporting


def tf(x: float) -> str:
    """TFLOP/s with sensible digits (a CPU reaches well under 1)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def fmt(v: Any, spec: str = ".3f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if math.isnan(v):
            return none
        return format(v, spec)
    return str(v)


def spread(r: dict, key: str, spec: str = ".3f") -> str:
    """``r[key]``, with the range over repeated runs where there is one: ``median (min-max)``."""
    value = fmt(r.get(key), spec)
    rng = r.get(f"{key}_range")
    if value == "-" or not rng or rng[0] == rng[1]:
        return value
    return f"{value} ({rng[0]:{spec}}-{rng[1]:{spec}})"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def kernel_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "form",
        "shape",
        "cuBLAS ms",
        "triton ms",
        "triton speedup",
        "gram ms",
        "dispatch",
        "faster",
        "gram/cuBLAS",
        "never slower",
        "triton err",
        "exact sym",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["kind"], r["shape"], "ERROR " + r["error"][:60]] + [""] * 9)
            continue
        body.append(
            [
                "X X^T" if r["kind"] == "gram" else "c*AA+b*A",
                r["shape"],
                fmt(r["cublas_ms"], ".4f"),
                fmt(r.get("triton_ms"), ".4f"),
                fmt(r.get("speedup_triton"), ".2f"),
                fmt(r["gram_ms"], ".4f"),
                r["dispatch"],
                fmt(r.get("faster")),
                fmt(r["gram_vs_cublas"], ".2f"),
                fmt(r["dispatch_ok"]),
                fmt(r.get("triton_err"), ".1e"),
                fmt(r.get("triton_symmetric")),
            ]
        )
    return h, body


def ortho_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "shape",
        "variant",
        "ms",
        "TFLOP/s",
        "% of peak",
        "plain-matmul floor ms",
        "err vs fp64 loop",
        "err vs exact polar, Gaussian",
        "err vs exact polar, low rank + noise",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["shape"], r["name"], "ERROR " + r["error"][:60], *[""] * 6])
            continue
        body.append(
            [
                r["shape"],
                r["name"],
                spread(r, "ms"),
                tf(r["tflops"]),
                fmt(r["pct_peak"], ".1f"),
                fmt(r["floor_ms"]),
                fmt(r.get("err_fp64"), ".1e"),
                fmt(r.get("polar_err_gauss"), ".4f"),
                fmt(r.get("polar_err_low_rank"), ".4f"),
            ]
        )
    return h, body


def step_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "workload",
        "optimizer",
        "step ms (median)",
        "x faster than torch.optim.Muon",
        "x faster than naive",
        "first step ms",
        "note",
    ]
    body = []
    for r in rows:
        note = r.get("skipped") or (("ERROR " + r["error"][:60]) if "error" in r else "")
        if r.get("vs_fused_adamw") is not None:
            note = f"{r['vs_fused_adamw']:.2f}x fused AdamW"
        body.append(
            [
                r["workload"],
                r["name"],
                spread(r, "ms"),
                fmt(r.get("speedup_vs_torch"), ".2f"),
                fmt(r.get("speedup_vs_naive"), ".2f"),
                spread(r, "first_step_ms", ".1f"),
                note,
            ]
        )
    return h, body


def peak_over_state(r: dict) -> float | None:
    """Whole-run peak above params and grads, in units of the optimizer's own state."""
    if r.get("peak_mib") is None or not r.get("state_mib"):
        return None
    return r["peak_mib"] / r["state_mib"]


def memory_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "workload",
        "optimizer",
        "state MiB",
        "state B/param",
        "peak MiB above params+grads",
        "peak / state",
        "steady step peak MiB (delta)",
        "first step peak MiB (delta)",
        "kept between steps: graph pools / other MiB",
    ]
    body = []
    for r in rows:
        if "skipped" in r or "error" in r:
            continue
        body.append(
            [
                r["workload"],
                r["name"],
                fmt(r.get("state_mib"), ".1f"),
                fmt(r.get("state_bytes_per_param"), ".2f"),
                spread(r, "peak_mib", ".0f"),
                fmt(peak_over_state(r), ".2f"),
                spread(r, "step_peak_mib", ".0f"),
                spread(r, "first_step_peak_mib", ".0f"),
                f"{spread(r, 'graph_pools_mib', '.0f')} / {spread(r, 'kept_mib', '.0f')}",
            ]
        )
    return h, body


def text_table(headers: list[str], body: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def meta_info(args, device: torch.device, cfg: Config, argv: list[str]) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not importable"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu
        or f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "muon_plugin": getattr(muon_plugin, "__version__", "?"),
        "command": shlex.join(["python", *argv]),
        "sizes": "full" if cfg.full else f"small (matrix dims / {cfg.div})",
        "quick": args.quick,
    }


def markdown_section(meta: dict, results: dict[str, list[dict]], peak: dict | None) -> str:
    out = [
        MARK_START,
        "## Benchmark (`scripts/benchmark.py`)",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- torch {meta['torch']}, triton {meta['triton']}, Python {meta['python']}, "
        f"muon_plugin {meta['muon_plugin']}",
        f"- command: `{meta['command']}`",
        f"- sizes: {meta['sizes']}",
    ]
    if peak:
        out.append(
            f"- measured peak: {peak['name']} at {tf(peak['tflops'])} TFLOP/s ({peak['ms']:.3f} ms)"
        )
    out.append(
        "- times are medians; `optimizer.step()` is timed step by step after warm-up; "
        "ratios > 1 mean faster than the reference row"
    )
    if meta.get("runs", 1) > 1:
        out.append(
            f"- {meta['runs']} runs in separate processes: each figure is the median of the "
            "runs' figures, with their range in parentheses"
        )
    for key, title, table in (
        ("kernels", "Symmetric Gram kernel vs cuBLAS (bf16)", kernel_table),
        (
            "ortho",
            "Orthogonalization, 5 steps (FLOPs counted as plain matmuls; Gram-space runs fewer)",
            ortho_table,
        ),
        ("step", "optimizer.step() (fp32 params and grads; the bf16 workload: bf16)", step_table),
        ("memory", "Optimizer memory", memory_table),
    ):
        if key in results:
            h, body = table(results[key])
            out += ["", f"### {title}", "", md_table(h, body)]
    out += ["", MARK_END]
    return "\n".join(out) + "\n"


def write_results(path: Path, section: str) -> None:
    replace_section(path, section, MARK_START, MARK_END)


def summary(results: dict[str, list[dict]], peak: dict | None, meta: dict, cfg: Config) -> str:
    """The closing summary: one block per section that ran."""
    lines = [
        "",
        "=" * 100,
        f"SUMMARY  {meta['device']} | torch {meta['torch']} | triton "
        f"{meta['triton']} | sizes: {meta['sizes']}",
    ]
    if peak:
        lines.append(f"peak: {peak['name']} {tf(peak['tflops'])} TFLOP/s")
    if "kernels" in results:
        lines += summary_kernels(results["kernels"])
    if "ortho" in results:
        lines.append("\n[ortho] zeropower, 5 steps")
        lines += ["  " + ortho_line(r) for r in results["ortho"]]
    if "step" in results:
        lines += summary_step(results["step"], cfg)
    if "memory" in results:
        lines += summary_memory(results["memory"])
    lines.append("=" * 100)
    return "\n".join(lines)


def summary_kernels(rows: list[dict]) -> list[str]:
    lines = ["\n[kernels] ms: cuBLAS / triton / gram(dispatch)"]
    lines += ["  " + kernel_line(r) for r in rows]
    bad = [r for r in rows if r.get("dispatch_ok") is False]
    lines.append(
        "  dispatch never slower than cuBLAS: "
        + ("yes" if not bad else "NO at " + ", ".join(f"{r['kind']} {r['shape']}" for r in bad))
    )
    return lines


def step_summary_line(r: dict) -> str | None:
    """One ``optimizer.step()`` row of the summary (None for a skipped peer)."""
    head = f"  {r['workload']:<18} {r['name']:<30}"
    if "skipped" in r:
        return None if r["group"] == "peer" else f"{head} skipped: {r['skipped']}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:80]}"
    extra = ""
    if r.get("vs_fused_adamw") is not None:
        extra = (
            f"  = {r['vs_fused_adamw']:.2f}x fused AdamW "
            f"({'within' if r['within_2x_adamw'] else 'NOT within'} 2x)"
        )
    elif r.get("floor_ms") and r["name"] != "AdamW(fused=True)":
        extra = f"  {r['ms'] / r['floor_ms']:.2f}x the plain-matmul floor"
    return (
        f"{head} {r['ms']:9.3f}  x{fmt(r.get('speedup_vs_torch'), '.2f'):>5} / "
        f"x{fmt(r.get('speedup_vs_naive'), '.2f'):>5}{extra}"
    )


def summary_step(rows: list[dict], cfg: Config) -> list[str]:
    lines = ["\n[step] optimizer.step() median ms; x = speedup vs torch.optim.Muon / vs naive"]
    lines += [line for r in rows if (line := step_summary_line(r)) is not None]
    peers = sorted({f"{r['name']} ({r['skipped']})" for r in rows
                    if r["group"] == "peer" and "skipped" in r})  # fmt: skip
    if peers:
        lines.append("  peers skipped: " + ", ".join(peers))
    if cfg.full:
        lines += [
            f"  anchors.md ({wl}, H200): " + ", ".join(f"{k} {v:g}" for k, v in anchors.items())
            for wl, anchors in ANCHORS_MS.items()
        ]
    floors = {r["workload"]: r.get("floor_ms") for r in rows}
    lines += [f"  {wl}: plain-matmul floor {f:.2f} ms at the measured peak"
              for wl, f in floors.items() if f]  # fmt: skip
    return lines


def summary_memory(rows: list[dict]) -> list[str]:
    lines = [
        "\n[memory] state; peak above params and grads over building and all steps "
        "(CUDA-graph pools included), also in units of the state"
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            continue
        peak_mib = r.get("peak_mib")
        lines.append(
            f"  {r['workload']:<18} {r['name']:<30} "
            f"{fmt(r.get('state_bytes_per_param'), '.2f'):>6} B/param  "
            f"{fmt(r.get('state_mib'), '.1f'):>9} MiB  peak "
            + (
                f"+{peak_mib:.0f} MiB ({fmt(peak_over_state(r), '.2f')}x state)"
                if peak_mib is not None
                else "n/a (CPU)"
            )
        )
    return lines


def clean_json(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    if isinstance(v, dict):
        return {k: clean_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [clean_json(x) for x in v]
    return v


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="markdown file whose benchmark section is created/updated (e.g. RESULTS.md); "
        "without it nothing is written",
    )
    p.add_argument("--json", type=Path, help="write all rows to this JSON file")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the benchmark this many times, each in its own process, and report every "
        "figure as the median of the runs with their range",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: report the runs saved with --json (separate processes, machines "
        "starts or days) as medians with their ranges",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--rows",
        default="",
        help="step and memory sections: only the rows whose name contains one of these "
        "comma-separated words (case-insensitive), e.g. 'MuonForeach (polar,MuonLP (int8'",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"step and memory sections: a comma-separated subset of {','.join(WORKLOADS)}",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new step row after this many seconds (later rows are marked skipped); "
        "with --json the file is rewritten after every row, so a run stopped from outside "
        "still leaves what it measured",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="also time MuonForeach(compile=True) on small runs",
    )
    g.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="skip the MuonForeach(compile=True) row",
    )
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    args.sections = [s for s in SECTIONS if s in sections]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or set(workloads) - set(WORKLOADS):
        p.error(f"--workloads {args.workloads!r}: choose from {','.join(WORKLOADS)}")
    args.workloads = tuple(w for w in WORKLOADS if w in workloads)
    args.rows = tuple(r.strip().lower() for r in args.rows.split(",") if r.strip())
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget {args.budget}: must be a positive number of seconds")
    return args


def run_sections(args, cfg: Config, device: torch.device, timer, peak, log, saved) -> dict:
    """The rows of every section asked for, each timed and logged; ``saved(results)`` after
    every step row, with everything measured so far."""
    results: dict[str, list[dict]] = {}

    def saved_step_rows(step_rows: list[dict], mem_rows: list[dict]) -> None:
        partial = dict(results)
        for key, rows in (("step", step_rows), ("memory", mem_rows)):
            if key in args.sections:
                partial[key] = rows
        saved(partial)

    def timed_section(name: str, fn):
        t0 = time.perf_counter()
        log(f"\n[{name}]")
        out = fn()
        log(f"  ({name}: {time.perf_counter() - t0:.1f} s)")
        return out

    if "kernels" in args.sections:
        results["kernels"] = timed_section(
            "kernels", lambda: section_kernels(cfg, device, timer, log)
        )
    if "ortho" in args.sections:
        results["ortho"] = timed_section(
            "ortho", lambda: section_ortho(cfg, device, timer, peak, log)
        )
    if "step" in args.sections or "memory" in args.sections:
        name = "+".join(s for s in ("step", "memory") if s in args.sections)
        step_rows, mem_rows = timed_section(
            name,
            lambda: section_step(
                cfg,
                device,
                timer,
                peak,
                "step" in args.sections,
                "memory" in args.sections,
                log,
                saved_step_rows,
            ),
        )
        for key, rows in (("step", step_rows), ("memory", mem_rows)):
            if key in args.sections:
                results[key] = rows
    return results


def write_json(args, meta: dict, results: dict, peak) -> None:
    """All rows as ``--json`` keeps them (replaced whole, so a reader never sees half a file)."""
    rows = ([peak] if peak else []) + [r for s in args.sections for r in results.get(s, [])]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps(clean_json({"meta": meta, "rows": rows}), indent=1))
    tmp.replace(args.json)


def write_outputs(args, meta: dict, results: dict, peak, log) -> None:
    """The JSON rows (``--json``) and the RESULTS.md section (only with ``--results``)."""
    if args.json:
        write_json(args, meta, results, peak)
        log(f"wrote {args.json}")
    if args.results is not None:
        write_results(args.results, markdown_section(meta, results, peak))
        log(f"updated {args.results}")


RUN_KEYS = ("section", "workload", "shape", "kind", "name")
"""The fields that name a row (the same row in every run)."""


def child_command(raw_argv: list[str], json_path: Path) -> list[str]:
    """This run's command line without --repeats, --results and --json, writing ``json_path``."""
    out, skip = [], False
    for a in raw_argv[1:]:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--repeats", "--results", "--json"):
            skip = "=" not in a
            continue
        out.append(a)
    return [sys.executable, str(Path(__file__).resolve()), *out, "--json", str(json_path)]


def aggregate(runs: list[list[dict]]) -> list[dict]:
    """One row per row of the runs: numbers are the median over the runs where the row has
    them, with ``<field>_range`` (min, max) and ``runs``; everything else from the first run."""
    merged: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            merged.setdefault(tuple(r.get(k) for k in RUN_KEYS), []).append(r)
    out = []
    for same in merged.values():
        row = dict(same[0])
        for key, value in same[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values = [r[key] for r in same if isinstance(r.get(key), (int, float))]
                row[key] = statistics.median(values)
                row[f"{key}_range"] = (min(values), max(values))
        row["runs"] = len(same)
        out.append(row)
    return out


def run_repeats(args, raw_argv: list[str]) -> int:
    """``--repeats N``: N runs in separate processes, then the medians and ranges."""
    import tempfile

    datas, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            path = Path(tmp) / f"run{i}.json"
            print(f"\n===== run {i + 1} of {args.repeats} (its own process) =====", flush=True)
            rc = subprocess.run(child_command(raw_argv, path)).returncode
            status = status or rc
            if path.exists():
                datas.append(json.loads(path.read_text()))
    if not datas:
        print("benchmark: no run produced results", file=sys.stderr)
        return status or 1
    report_runs(args, shlex.join(["python", *raw_argv]), datas)
    return status


def report_runs(args, command: str, datas: list[dict]) -> None:
    """Summarize runs (each a ``--json`` file's content) as medians with their ranges."""
    rows = aggregate([d["rows"] for d in datas])
    metas = [d["meta"] for d in datas]
    meta = {**metas[0], "runs": len(datas), "command": command}
    meta["dates"] = [m["date"] for m in metas]
    cut = sum(bool(m.get("partial")) for m in metas)
    if cut:
        print(f"note: {cut} of the {len(metas)} runs stopped early (partial files)", flush=True)
        meta["partial_runs"] = cut
    sections = [s for s in SECTIONS if any(r.get("section") == s for r in rows)]
    results = {s: [r for r in rows if r.get("section") == s] for s in sections}
    peak = next((r for r in rows if r.get("section") == "peak"), None)
    cfg = make_config(bool(meta.get("gpu")), args.quick, False)
    print(summary(results, peak, meta, cfg), flush=True)
    args.sections = sections
    write_outputs(args, meta, results, peak, lambda msg: print(msg, flush=True))


def merge_runs(args) -> int:
    """``--merge A.json B.json ...``: report runs saved earlier with ``--json`` as one."""
    datas = []
    for path in args.merge:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"benchmark: --merge {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(data, dict) or not {"meta", "rows"} <= data.keys():
            print(f"benchmark: --merge {path}: not a benchmark --json file", file=sys.stderr)
            return 2
        datas.append(data)
    commands = sorted({d["meta"].get("command", "?") for d in datas})
    report_runs(args, " ; ".join(commands), datas)
    return 0


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv if argv is None else ["scripts/benchmark.py", *argv]
    args = parse_args(argv)
    if args.merge:
        return merge_runs(args)
    if args.repeats > 1:
        return run_repeats(args, raw_argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmark: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t_start = time.perf_counter()
    select = Selection(
        args.rows, args.workloads, None if args.budget is None else t_start + args.budget
    )
    cfg = dataclasses.replace(make_config(cuda, args.quick, args.compile), select=select)
    timer = Timer(device)
    meta = meta_info(args, device, cfg, raw_argv)
    torch.manual_seed(0)

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(
        f"benchmark: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"sizes {meta['sizes']}, sections {','.join(args.sections)}"
    )
    peak = None
    if "ortho" in args.sections or "step" in args.sections:
        peak = measure_peak(cfg, device, timer)
        log(f"peak: {peak['name']}: {peak['ms']:.3f} ms, {tf(peak['tflops'])} TFLOP/s")

    def saved(partial: dict) -> None:
        if args.json:
            write_json(args, {**meta, "partial": True}, partial, peak)

    results = run_sections(args, cfg, device, timer, peak, log, saved)
    meta["total_s"] = time.perf_counter() - t_start
    write_outputs(args, meta, results, peak, log)
    for key, table in (
        ("kernels", kernel_table),
        ("ortho", ortho_table),
        ("step", step_table),
        ("memory", memory_table),
    ):
        if key in results:
            log(f"\n{key}:")
            log(text_table(*table(results[key])))
    log(summary(results, peak, meta, cfg))
    failures = [
        r
        for s in results.values()
        for r in s
        if "error" in r and (r.get("required") or r.get("section") in ("kernels", "ortho"))
    ]
    log(f"total {meta['total_s']:.1f} s" + (f"; {len(failures)} FAILED rows" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
