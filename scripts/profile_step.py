"""Where one ``optimizer.step()`` spends its time: a kernel table from torch.profiler.

    python scripts/profile_step.py --workload gpt --steps 5 [--trace trace.json]

Builds one of ``benchmark.py``'s workloads (``scripts/bench/workloads.py``; fp32 params and
grads), warms the optimizer up, then profiles ``--steps`` steps and prints, per step: the wall
time (CUDA events), the time some kernel was running on the GPU (the union of kernel intervals:
the rest is the GPU waiting for the host or for a dependency), the summed kernel time over all
streams, the kernel count, and the kernels grouped by name with their share. Before profiling,
the host's time in ``step()`` (until it returns, the GPU not waited for) beside the step's wall
time, unprofiled: where the two are close, the step is bound by the host. ``--timeline`` adds,
for the last profiled step, where the GPU waited: the time from the host's entry into
``step()`` to the first kernel, the idle gaps between kernels with the kernels around them,
and the step's last kernels. ``--trace`` also writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.config import LR, WD  # noqa: E402
from bench.workloads import gpt_shapes, llama_shapes, make_workload  # noqa: E402

from muon_plugin import MuonForeach, MuonLP  # noqa: E402

OPTIMIZERS = {
    "foreach": lambda ps: MuonForeach(ps, lr=LR, wd=WD),
    "normuon": lambda ps: MuonForeach(ps, lr=LR, wd=WD, normalization="normuon"),
    "lp-int8": lambda ps: MuonLP(ps, lr=LR, wd=WD, state_dtype="int8"),
    "lp-int4": lambda ps: MuonLP(ps, lr=LR, wd=WD, state_dtype="int4"),
    "turbo": lambda ps: MuonForeach(
        ps, lr=LR, wd=WD, orthogonalization_strategy="turbo_muon", ns_steps=4
    ),
}


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def host_and_wall_ms(opt: torch.optim.Optimizer, steps: int) -> tuple[list[float], list[float]]:
    """Per step: the host's time until ``step()`` returns, and the wall time until the GPU is
    done (the GPU idle before each step, so the host's time is not hidden behind earlier work)."""
    host, wall = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return host, wall


def kernel_events(prof: torch.profiler.profile) -> list:
    """The profile's device kernels (memcpy and memset included; the GPU-side ranges of user
    annotations such as ``Optimizer.step#...`` left out)."""
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        if getattr(e, "is_user_annotation", False) or e.name.startswith("Optimizer."):
            continue
        out.append(e)
    return out


def report(prof: torch.profiler.profile, steps: int, wall_ms: list[float], top: int) -> str:
    kernels = kernel_events(prof)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    summed = sum(e - s for s, e in spans)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.elapsed_us())
    lines = [
        f"steps profiled: {steps}; step wall ms (CUDA events): "
        + ", ".join(f"{t:.3f}" for t in wall_ms),
        f"per step: GPU busy {busy_us(spans) / steps / 1e3:.3f} ms, kernel time summed over "
        f"streams {summed / steps / 1e3:.3f} ms, {len(kernels) / steps:.0f} kernels",
        "",
        f"{'ms/step':>8} {'share':>6} {'calls/step':>10} {'us/call':>8}  kernel",
    ]
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    for name, ts in ranked[:top]:
        t = sum(ts)
        lines.append(
            f"{t / steps / 1e3:8.3f} {t / summed:6.1%} {len(ts) / steps:10.1f} "
            f"{t / len(ts):8.1f}  {name[:110]}"
        )
    rest = sum(sum(ts) for _, ts in ranked[top:])
    if rest:
        lines.append(f"{rest / steps / 1e3:8.3f} {rest / summed:6.1%} {'':>10} {'':>8}  (others)")
    return "\n".join(lines)


def timeline(prof: torch.profiler.profile, gaps: int = 12, tail: int = 12) -> str:
    """The last profiled step's GPU timeline: lead, idle gaps (largest first), last kernels."""
    steps = sorted(
        e.time_range.start
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("Optimizer.step#")
    )
    if not steps:
        return "timeline: no Optimizer.step range in the profile"
    t0 = steps[-1]
    kernels = sorted(
        (e for e in kernel_events(prof) if e.time_range.start >= t0),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return "timeline: no kernel after the last step's start"
    lines = [
        f"last step's timeline (us from the host's entry into step()): first kernel at "
        f"{kernels[0].time_range.start - t0:.1f}, last kernel done at "
        f"{max(e.time_range.end for e in kernels) - t0:.1f}"
    ]
    idle, end, before = [], kernels[0].time_range.end, kernels[0]
    for e in kernels[1:]:
        if e.time_range.start > end:
            idle.append((e.time_range.start - end, end - t0, before.name, e.name))
        if e.time_range.end > end:
            end, before = e.time_range.end, e
    lines.append(
        f"idle between kernels: {sum(g[0] for g in idle):.1f} us in {len(idle)} gaps; largest:"
    )
    for gap, at, a, b in sorted(idle, reverse=True)[:gaps]:
        lines.append(f"  {gap:7.1f} us at {at:8.1f}: {a[:45]} -> {b[:45]}")
    lines.append("last kernels (start, duration us, stream):")
    for e in kernels[-tail:]:
        lines.append(
            f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():7.1f} "
            f"{e.thread:>3}  {e.name[:70]}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="foreach")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", type=Path, help="write a Chrome trace here")
    p.add_argument("--timeline", action="store_true", help="the last step's GPU timeline")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE set before building")
    args = p.parse_args()
    for kv in args.env:
        key, _, value = kv.partition("=")
        os.environ[key] = value
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA device")
    device = torch.device("cuda")
    shapes = gpt_shapes(12, 1) if args.workload == "gpt" else llama_shapes(4, 1)
    wl = make_workload(args.workload, shapes, device, iters=args.steps)
    opt = OPTIMIZERS[args.optimizer](wl.params)
    for _ in range(args.warmup):
        opt.step()
    torch.cuda.synchronize()
    host, timed = host_and_wall_ms(opt, args.steps)
    wall = []
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            opt.step()
            b.record()
            b.synchronize()
            wall.append(a.elapsed_time(b))
    print(f"{args.workload}, {args.optimizer}, env {args.env or 'default'}")
    print(
        f"unprofiled, median of {args.steps} steps: host in step() {median(host):.3f} ms, "
        f"wall {median(timed):.3f} ms (host / wall {median(host) / median(timed):.2f})"
    )
    print(report(prof, args.steps, wall, args.top))
    if args.timeline:
        print(timeline(prof))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
