"""Two optimizers' step times measured in alternation, in one process, for a ratio that drifts
with neither the machine nor the process.

    python scripts/step_ab.py --workload gpt --optimizers foreach,normuon --rounds 30

Separate benchmark runs of one row on one H100 spread by several percent (GPT-125M's Muon step:
4.04 to 4.30 ms across processes of one machine), more than the few percent a variant such as
NorMuon adds. Here each optimizer steps on its own copy of one of ``benchmark.py``'s workloads
(``scripts/bench/workloads.py``; fp32 params and grads), and the rounds alternate between them
(each round: ``--steps`` back-to-back steps of one, timed by CUDA events, then of the other, the
order swapped every round). Without a GPU it times the CPU by the wall clock (``--small``: a
smoke run). Printed: each optimizer's median step (ms) with the spread of its
rounds, and the median of the rounds' ratios to the first optimizer with their spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workloads import gpt_shapes, llama_shapes, make_workload  # noqa: E402
from profile_step import OPTIMIZERS  # noqa: E402


def round_ms(opt: torch.optim.Optimizer, steps: int) -> float:
    """Mean ms of ``steps`` back-to-back steps (the GPU idle before the first; on the CPU, by
    the wall clock)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        return (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def spread(xs: list[float]) -> str:
    """``min-max`` of the middle half (the interquartile range)."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[0]:.3f}-{q[2]:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--optimizers", default="foreach,normuon", help="names of profile_step.py")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=5, help="back-to-back steps per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--small", action="store_true", help="2 layers, dims / 16 (a smoke run)")
    args = p.parse_args()
    names = args.optimizers.split(",")
    unknown = [n for n in names if n not in OPTIMIZERS]
    if len(names) < 2 or unknown:
        sys.exit(f"--optimizers: two or more of {sorted(OPTIMIZERS)} (unknown: {unknown})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers, div = (2, 16) if args.small else ((12, 1) if args.workload == "gpt" else (4, 1))
    shapes = gpt_shapes(layers, div) if args.workload == "gpt" else llama_shapes(layers, div)
    opts = []
    for name in names:
        wl = make_workload(args.workload, shapes, device, iters=1)
        opts.append(OPTIMIZERS[name](wl.params))
    for opt in opts:
        for _ in range(args.warmup):
            opt.step()
    times: list[list[float]] = [[] for _ in names]
    for r in range(args.rounds):
        order = range(len(opts)) if r % 2 == 0 else reversed(range(len(opts)))
        for i in order:
            times[i].append(round_ms(opts[i], args.steps))
    print(
        f"{args.workload}: {args.rounds} rounds of {args.steps} steps, alternating; "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
        f"torch {torch.__version__}"
    )
    for name, ts in zip(names, times, strict=True):
        line = f"  {name:>10}: median {statistics.median(ts):.3f} ms (IQR {spread(ts)})"
        if ts is not times[0]:
            ratios = [t / b for t, b in zip(ts, times[0], strict=True)]
            line += f"; / {names[0]}: median {statistics.median(ratios):.4f} (IQR {spread(ratios)})"
        print(line)


if __name__ == "__main__":
    main()
