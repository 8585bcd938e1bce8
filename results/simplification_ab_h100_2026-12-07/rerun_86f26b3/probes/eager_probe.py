"""Eager per-call cost of zeropower / run_path: this tree as it is, and with single pieces swapped
for the older formulas (prescale, first Gram scaling), to see which piece costs what."""

import timing  # this folder's timer
import torch

from muon_plugin import zeropower

NEW = hasattr(__import__("muon_plugin.kernels.matrix_scale", fromlist=["x"]), "prescale_")


def bench(fn):
    return timing.bench(fn, n=50, reps=7, warmup=10, unit=1e-6)


def cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(1024, 4096, device="cuda", generator=g)
    B = torch.randn(8, 1024, 1024, device="cuda", generator=g)
    C = torch.randn(768, 768, device="cuda", generator=g)
    D = torch.randn(768, 3072, device="cuda", generator=g)
    return {
        "zeropower 1024x4096": lambda: zeropower(A, 5, "polar_express"),
        "zeropower 8x1024x1024": lambda: zeropower(B, 5, "polar_express"),
        "zeropower 768x768": lambda: zeropower(C, 5, "polar_express"),
        "zeropower 768x3072": lambda: zeropower(D, 5, "polar_express"),
    }


def variants():
    yield "as is", lambda: None
    if NEW:
        import muon_plugin.kernels.matrix_scale as ms
        import muon_plugin.orthogonalize.iterations as it

        def old_prescale(X, below, above, kernel=False):
            import math

            amax = torch.linalg.vector_norm(
                X, ord=math.inf, dim=tuple(range(1, X.dim())), dtype=torch.float32
            )
            big = amax > above
            ms._torch_scale_(X, torch.where(big, torch.exp2(-torch.floor(torch.log2(amax))), 1.0))

        def swap_prescale():
            it.prescale_ = old_prescale

        yield "old prescale", swap_prescale

        def old_scaled(R32, f, dtype, extra=1.0):
            return R32.mul_(f * f * extra).to(dtype)

        def swap_scaled():
            it.scaled_gram = old_scaled

        yield "old prescale + old first-Gram scaling", swap_scaled


res = {}
for name, apply in variants():
    apply()
    for case, fn in cases().items():
        med, low, high = res[f"{case} | {name}"] = bench(fn)
        print(f"{case:24s} {name:40s} {med:9.1f} us  ({low:.1f}-{high:.1f})", flush=True)
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as p:
    fn = cases()["zeropower 1024x4096"]
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
