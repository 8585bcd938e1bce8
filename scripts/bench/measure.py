"""How the benchmark measures: median times (GPU and CPU), the plain-matmul FLOP count of the
orthogonalization, the bf16 matmul peak of this run, relative error, freeing memory between
rows."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.config import Config


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
    """Collect garbage and return cached CUDA memory (between rows and sections).

    Callers look it up here (``measure.free_memory()``), so one replacement reaches them all.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """Plain-matmul FLOPs of ``steps`` iterations on a (batch of) m x n matrix."""
    batch = math.prod(shape[:-2])
    m, n = sorted(shape[-2:])
    return batch * steps * (4.0 * m * m * n + 2.0 * m**3)


def measure_peak(cfg: Config, device: torch.device, timer: Timer) -> dict:
    """The bf16 matmul rate of this run (an n^3 product): the peak the sections compare to."""
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
