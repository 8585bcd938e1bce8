"""Host time of ``step()`` for Muon and NorMuon on GPT-125M, and where NorMuon's extra goes.

    python results/normuon_h100_2026-12-08_update_runs/host_profile.py [STEPS]

Run from the repository root on a CUDA machine. Per optimizer (Muon, NorMuon, twice each):
the median host time until ``step()`` returns and the synchronized wall time, unprofiled; then
cProfile over as many steps; last, per function, NorMuon's extra own and cumulative time per
step (ms, under the profiler) against Muon's.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from bench.workloads import gpt_shapes, make_workload  # noqa: E402
from profile_step import OPTIMIZERS, host_and_wall_ms  # noqa: E402


def profile(name: str, steps: int) -> dict[str, tuple[int, float, float]]:
    """Print ``name``'s host and wall medians and its cProfile top; per function (calls, own
    ms per step, cumulative ms per step)."""
    wl = make_workload("gpt", gpt_shapes(12, 1), torch.device("cuda"), iters=30)
    opt = OPTIMIZERS[name](wl.params)
    for _ in range(10):
        opt.step()
    host, wall = host_and_wall_ms(opt, steps)
    pr = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        pr.enable()
        opt.step()
        pr.disable()
    torch.cuda.synchronize()
    print(f"{name}: host in step() median {median(host):.3f} ms, synced wall {median(wall):.3f} ms")
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    return {
        f"{Path(k[0]).name}:{k[1]}:{k[2]}": (v[1], v[2] / steps * 1e3, v[3] / steps * 1e3)
        for k, v in stats.items()
    }


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    per_fn = {}
    for name in ("foreach", "normuon", "foreach", "normuon"):
        per_fn[name] = profile(name, steps)
        torch.cuda.empty_cache()
    a, b = per_fn["foreach"], per_fn["normuon"]
    none = (0, 0.0, 0.0)
    print("NorMuon's extra own time per step (ms), calls Muon / NorMuon, NorMuon's cumulative")
    for d, k in sorted(((b[k][1] - a.get(k, none)[1], k) for k in b), reverse=True)[:40]:
        print(f"{d:8.4f}  {a.get(k, none)[0]:>6}/{b[k][0]:<6}  cum {b[k][2]:8.4f}  {k}")
    print("NorMuon's extra cumulative time per step (ms)")
    for d, k in sorted(((b[k][2] - a.get(k, none)[2], k) for k in b), reverse=True)[:40]:
        print(f"{d:8.4f}  cum {b[k][2]:8.4f}  {k}")


if __name__ == "__main__":
    main()
