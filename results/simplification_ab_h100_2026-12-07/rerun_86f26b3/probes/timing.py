"""The probes' timer: median, min and max over ``reps`` repetitions of ``n`` calls, after
``warmup`` calls, in units of ``unit`` seconds (1e-3: ms, 1e-6: us)."""

import statistics
import time

import torch


def bench(fn, n: int, reps: int, warmup: int, unit: float) -> tuple[float, float, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / n / unit)
    return statistics.median(out), min(out), max(out)
