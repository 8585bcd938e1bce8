"""Kernel-level profile of zeropower on the cuBLAS-only path for this tree (old: env switch)."""

import os

import timing  # this folder's timer
import torch

from muon_plugin import zeropower

OLD = os.environ.get("TREE") == "old"


def call(X):
    if OLD:
        return zeropower(X, 5, "polar_express")
    return zeropower(X, 5, "polar_express", backend="cublas")


def bench(fn):
    return timing.bench(fn, n=20, reps=7, warmup=5, unit=1e-3)


g = torch.Generator(device="cuda").manual_seed(0)
for shape in [(4096, 14336), (1024, 4096)]:
    X = torch.randn(*shape, device="cuda", generator=g)
    print(
        f"== {os.environ.get('TREE')} {shape} ms median/min/max",
        bench(lambda X=X: call(X)),
        flush=True,
    )
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as p:
        for _ in range(5):
            call(X)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
