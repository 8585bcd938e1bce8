"""MuonLP: optimizer-state bytes, step time and final loss per ``state_dtype``, against fp32 Muon.

Trains the same small residual MLP (teacher-student regression on fresh synthetic batches, a
fixed held-out set for the final loss) once with ``MuonForeach`` (fp32 momentum) and once per
``MuonLP`` state dtype, from the same initialization and data, and prints:

- bytes of Muon optimizer state per Muon parameter element (codes + scales; fp32 is 4.0),
- the median ``optimizer.step()`` time, and its ratio to fp32-state ``MuonForeach``,
- the final held-out loss and its relative difference to the fp32-state run.

Uses CUDA when available. ``--quick`` is a shorter, smaller run (the CPU default).
``--results PATH`` writes the table into its own marked section of a markdown file
(e.g. RESULTS.md), replacing an earlier run's.

    python scripts/bench_lp.py                 # GPU: a few hundred steps
    python scripts/bench_lp.py --quick         # CPU: well under 3 minutes on 2 cores
    python scripts/bench_lp.py --compile --results RESULTS.md   # adds compile time

Eager ``MuonLP`` requantizes with torchao's ops one parameter at a time (tens of small
kernels each); ``--compile`` (``compile=True``) fuses them, which is how to use it for speed.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for results_md
from results_md import replace_section  # noqa: E402
from torch import nn

from muon_plugin import MuonForeach, MuonLP

MARK_START = "<!-- bench_lp:start -->"
MARK_END = "<!-- bench_lp:end -->"

TARGET_BYTES = {"int8": 1.1, "int4": 0.6, "fp8": 1.1, "bf16": 2.0}
TARGET_LOSS = 0.02


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))).square())


class Net(nn.Module):
    def __init__(self, d_in: int, dim: int, hidden: int, depth: int, d_out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def param_groups(model: Net) -> list[dict]:
    """Muon for the block matrices; AdamW for input/output layers, norms and biases."""
    muon = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.ndim == 2]
    ids = {id(p) for p in muon}
    adam = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": muon}, {"params": adam, "algorithm": "adamw", "lr": 3e-3}]


def make_optimizer(model: Net, state_dtype: str, args) -> torch.optim.Optimizer:
    kwargs = dict(lr=args.lr, wd=0.01, compile=args.compile)
    if state_dtype == "fp32":
        return MuonForeach(param_groups(model), **kwargs)
    return MuonLP(param_groups(model), state_dtype=state_dtype, **kwargs)


def state_bytes_per_param(opt: torch.optim.Optimizer) -> float:
    if isinstance(opt, MuonLP):
        nbytes, numel = opt.state_bytes()
        return nbytes / numel
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    nbytes = sum(
        opt.state[p]["momentum_buffer"].numel() * opt.state[p]["momentum_buffer"].element_size()
        for p in muon
    )
    return nbytes / sum(p.numel() for p in muon)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(state_dtype: str, teacher: Net, args, device: torch.device) -> dict:
    torch.manual_seed(1)
    model = Net(args.d_in, args.dim, args.hidden, args.depth, args.d_out).to(device)
    opt = make_optimizer(model, state_dtype, args)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / args.steps)
    )
    data = torch.Generator(device=device).manual_seed(1234)
    eval_gen = torch.Generator(device=device).manual_seed(999)
    x_eval = torch.randn(args.eval_batch, args.d_in, device=device, generator=eval_gen)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    times = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.d_in, device=device, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        sched.step()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x_eval), y_eval).item()
    skip = min(5, len(times) - 1)  # first steps: state allocation, compilation
    return {
        "state_dtype": state_dtype,
        "bytes": state_bytes_per_param(opt),
        "step_ms": 1e3 * statistics.median(times[skip:]),
        "loss": final,
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short small run (CPU default)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="MuonForeach/MuonLP compile=True")
    parser.add_argument(
        "--dtypes", default="bf16,int8,int4,fp8", help="comma-separated MuonLP state dtypes"
    )
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument(
        "--results", default=None, help="write the MuonLP section of this markdown file"
    )
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = args.quick or device.type == "cpu"
    if quick:
        args.d_in, args.dim, args.hidden, args.depth, args.d_out = 64, 256, 1024, 2, 64
        args.batch, args.eval_batch = 256, 2048
        args.steps = args.steps or 120
    else:
        args.d_in, args.dim, args.hidden, args.depth, args.d_out = 256, 1024, 4096, 6, 256
        args.batch, args.eval_batch = 1024, 8192
        args.steps = args.steps or 400
    args.warmup = max(1, args.steps // 20)
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)
    teacher = Net(args.d_in, args.dim // 2, args.hidden // 2, 2, args.d_out).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)

    setup = (
        f"model dim {args.dim} hidden {args.hidden} depth {args.depth} "
        f"({2 * args.depth} Muon matrices), {args.steps} steps, batch {args.batch}, "
        f"compile={args.compile}"
    )
    print(f"bench_lp: {device_name(device)}, torch {torch.__version__}, {setup}", flush=True)
    start = time.perf_counter()
    rows = []
    for state_dtype in ["fp32", *args.dtypes.split(",")]:
        rows.append(run(state_dtype, teacher, args, device))
        r = rows[-1]
        print(
            f"  {state_dtype}: {r['bytes']:.3f} B/param, {r['step_ms']:.2f} ms/step, "
            f"loss {r['loss']:.5f}",
            flush=True,
        )
    base = rows[0]
    lines = [
        "| state | bytes/param | target | step ms | vs fp32 | final loss | vs fp32 | within 2% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = TARGET_BYTES.get(r["state_dtype"])
        rel = r["loss"] / base["loss"] - 1
        ok_bytes = ""
        if target is not None:
            ok_bytes = f"<= {target:.1f} {'ok' if r['bytes'] <= target else 'MISS'}"
        lines.append(
            f"| {r['state_dtype']} | {r['bytes']:.3f} | {ok_bytes} | {r['step_ms']:.2f} | "
            f"{r['step_ms'] / base['step_ms']:.2f}x | {r['loss']:.5f} | {100 * rel:+.2f}% | "
            f"{'-' if r is base else ('yes' if abs(rel) <= TARGET_LOSS else 'NO')} |"
        )
    table = "\n".join(lines)
    elapsed = time.perf_counter() - start
    print()
    print(table)
    print(f"\n({elapsed:.0f} s)")
    if args.results:
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        replace_section(
            args.results,
            f"{MARK_START}\n## MuonLP state dtypes ({datetime.date.today().isoformat()})\n\n"
            f"- device: {device_name(device)}\n- torch: {torch.__version__}\n"
            f"- command: `{command}`\n- {setup}\n"
            f"- fp32 = `MuonForeach` (fp32 momentum); step time is `optimizer.step()` only "
            f"(median); final loss on a held-out set\n\n{table}\n{MARK_END}\n",
            MARK_START,
            MARK_END,
        )


if __name__ == "__main__":
    main()
