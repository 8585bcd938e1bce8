#!/usr/bin/env python
"""Scaling of the distributed Muon step: Llama-3-8B matrices, FSDP and FSDP x TP on N ranks.

The workload is the Muon part of Llama 3 8B: ``--layers`` (32) layers of wq 4096x4096,
wk/wv 1024x4096, wo 4096x4096, w1/w3 14336x4096, w2 4096x14336 (every dim divided by
``--dim-div``), bf16 parameters and gradients. For each world size N it is laid out with the real
APIs (scripts/bench_comm.py's ``shard_layers``: ``fully_shard`` per layer on a 1-D mesh, i.e.
Shard(0) DTensors; and TP=``--tp`` under FSDP when N >= 2 * tp), built on the meta device and
materialized on each rank's device, and ``MuonForeach.step()`` is timed (CUDA events on GPUs,
``perf_counter`` on CPU; per step the slowest rank, median over ``--steps`` after
``--warmup``). N = 1 is the unsharded single-device step (layout ``single``), the baseline of

    speed-up = T(1) / T(N),   efficiency = T(1) / (N * T(N))   (target >= 85% on H200s)

Bytes are what each rank sent per step (the plan's all-to-all buffers) and the minimum for the
same owners (scripts/bench_comm.py's accounting).

    python scripts/bench_scaling.py                       # driver: torchrun per N in 1,2,4,8
        [--device cuda|cpu] [--world-sizes 1,2,4,8] [--layers 32] [--dim-div 1] [--tp 2]
        [--steps 10] [--warmup 3] [--results RESULTS.md] [--json rows.json]
    torchrun --nproc-per-node 8 scripts/bench_scaling.py  # one world size, table on rank 0

The driver runs ``torchrun --standalone --nproc-per-node N`` for each N in the given order (up
to the GPUs present; on CPU, gloo: 1,2 by default; ``1,8,4,2`` measures 8 early) and writes the
table into RESULTS.md between ``<!-- bench_scaling:start -->`` and ``<!-- bench_scaling:end -->``
after every N, so a run cut short still records what it measured. CPU smoke test:
``--device cpu --dim-div 32 --layers 2``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_comm import (  # noqa: E402
    Layer,
    exit_without_teardown,
    machine,
    shard_layers,
    traffic,
)
from results_md import write_section  # noqa: E402
from torch import nn  # noqa: E402

from muon_plugin.distributed.report import format_bytes  # noqa: E402

DIM, KV, HIDDEN = 4096, 1024, 14336  # Llama 3 8B
TARGET_EFFICIENCY = 0.85
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if a GPU is present, else cpu")  # fmt: skip
    parser.add_argument(
        "--world-sizes", default=None, help="default 1,2,4,8 up to the GPUs; cpu 1,2"
    )
    parser.add_argument("--layouts", default="fsdp,fsdp x tp")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim-div", type=int, default=1, help="divide every matrix dim by this")
    parser.add_argument("--tp", type=int, default=2, help="TP degree of the FSDP x TP layout")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU process")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per torchrun launch")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def shapes(args) -> tuple[int, int, int]:
    return DIM // args.dim_div, KV // args.dim_div, HIDDEN // args.dim_div


def layouts_for(ws: int, args) -> list[str]:
    if ws == 1:
        return ["single"]
    wanted = [s.strip() for s in args.layouts.split(",") if s.strip()]
    fits_tp = ws >= 2 * args.tp and ws % args.tp == 0
    return [lay for lay in wanted if lay != "fsdp x tp" or fits_tp]


# ---------------------------------------------------------------------- one world size (worker)


def build(layout: str, ws: int, args, device: torch.device) -> list[tuple[str, nn.Parameter]]:
    """The layers on the meta device, laid out as ``layout``, materialized on ``device``."""
    d, kv, h = shapes(args)
    with torch.device("meta"):
        model = nn.Sequential(*(Layer(d, kv, h) for _ in range(args.layers)))
    model.to(DTYPES[args.dtype])
    if layout != "single":
        shard_layers(model, layout, ws, device_type=device.type, tp=args.tp)
    model.to_empty(device=device)
    named = list(model.named_parameters())
    gen = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    with torch.no_grad():
        for _, p in named:
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02, generator=gen)
            p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.normal_(0.0, 1.0, generator=gen)
    return named


def time_steps(opt, args, device: torch.device) -> list[float]:
    """Seconds of each timed ``opt.step()`` on this rank (all ranks start together)."""
    cuda = device.type == "cuda"
    times = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
    return times


def measure(layout: str, ws: int, args, device: torch.device) -> dict | None:
    from muon_plugin import MuonForeach

    named = build(layout, ws, args, device)
    opt = MuonForeach([p for _, p in named], lr=0.01)
    times = time_steps(opt, args, device)
    plan = opt._plans.plan
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    gathered: list = [None] * ws
    dist.all_gather_object(gathered, (dict(plan.last_stats), times, peak))
    row = None
    if dist.get_rank() == 0:
        per_step = [max(ts[i] for _, ts, _ in gathered) for i in range(len(times))]
        row = {
            "world_size": ws,
            "layout": layout,
            "mesh": mesh_text(layout, ws, args.tp),
            "params": len(named),
            "numel": sum(p.numel() for _, p in named),
            **traffic(plan, [s for s, _, _ in gathered]),
            "step_ms": statistics.median(per_step) * 1e3,
            "step_ms_min": min(per_step) * 1e3,
            "step_ms_max": max(per_step) * 1e3,
            "peak_mem_gib": max(m for _, _, m in gathered) / 2**30,
        }
    del opt, named
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    return row


def mesh_text(layout: str, ws: int, tp: int) -> str:
    if layout == "single":
        return "1"
    if layout == "fsdp x tp":
        return f"dp {ws // tp} x tp {tp}"
    return f"{layout} {ws}"


def worker(args) -> NoReturn:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    extra = {}
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        extra["device_id"] = device
        backend = "nccl"
    else:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600), **extra)
    rows = []
    try:
        for layout in layouts_for(ws, args):
            row = measure(layout, ws, args, device)
            if row is not None:
                rows.append(row)
                print(f"[bench_scaling] N={ws} {layout}: {row['step_ms']:.2f} ms", flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        if args.rows_out:
            args.rows_out.write_text(json.dumps(rows))
        else:  # launched by torchrun directly: report this world size alone
            finish(rows, args, [])
    exit_without_teardown()


# ---------------------------------------------------------------------- driver


def world_sizes(args) -> list[int]:
    if args.world_sizes:
        return [int(w) for w in args.world_sizes.split(",") if w.strip()]
    if args.device == "cpu":
        return [1, 2]
    gpus = torch.cuda.device_count()
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def run_torchrun(cmd: list[str], timeout: float, **kwargs) -> tuple[str, int]:
    """Run a torchrun command line: (stdout and stderr, return code; 124 on timeout).

    On timeout torchrun gets SIGTERM, on which it stops its workers (each in a session of its
    own: killing torchrun outright would leave them on the GPUs); SIGKILL after 30 s more.
    """
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs
    )
    try:
        return proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        return out, 124


def launch(ws: int, args, argv: list[str]) -> tuple[list[dict], str | None]:
    """Run one world size under torchrun; (rows, error or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ws), str(Path(__file__).resolve()),
            *argv, "--device", args.device, "--worker", "--rows-out", str(out),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if args.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(args.threads))
        log, rc = run_torchrun(cmd, args.timeout, env=env)
        if rc != 0 or not out.exists():
            print(log[-4000:], file=sys.stderr)
            why = f"timed out after {args.timeout} s" if rc == 124 else f"torchrun exited with {rc}"
            return [], why
        return json.loads(out.read_text()), None


def add_scaling(rows: list[dict]) -> None:
    """Speed-up and efficiency of every row against the N = 1 step."""
    base = next((r["step_ms"] for r in rows if r["world_size"] == 1), None)
    for r in rows:
        if base and r.get("step_ms"):
            r["speedup"] = base / r["step_ms"]
            r["efficiency"] = base / (r["world_size"] * r["step_ms"])
        else:
            r["speedup"] = r["efficiency"] = None


def table(rows: list[dict], errors: list[str]) -> str:
    header = (
        "| N | layout | mesh | matrices / rank | sent/rank (mean / max) | minimum | "
        "collectives | step ms (median) | min-max ms | speed-up | efficiency | peak GiB |"
    )
    lines = [header, "|" + " --- |" * 12]
    for r in rows:
        per_rank = r["matrices_per_rank"]
        eff = r.get("efficiency")
        eff_text = (
            "-"
            if eff is None
            else f"{100 * eff:.0f}%"
            + ("" if r["world_size"] == 1 or eff >= TARGET_EFFICIENCY else " (< 85%)")
        )
        speed = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"| {r['world_size']} | {r['layout']} | {r['mesh']} | "
            f"{min(per_rank)}-{max(per_rank)} | {format_bytes(r['sent_mean'])} / "
            f"{format_bytes(r['sent_max'])} | {format_bytes(r['minimum_mean'])} | "
            f"{r['collectives']} | {r['step_ms']:.2f} | "
            f"{r['step_ms_min']:.2f}-{r['step_ms_max']:.2f} | {speed} | {eff_text} | "
            f"{r['peak_mem_gib']:.1f} |"
        )
    lines += [f"| {e} | | | | | | | failed | | | | |" for e in errors]
    return "\n".join(lines)


def machine_text(args) -> str:
    if args.device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (NCCL)"
    return f"{machine()} (gloo, {args.threads} thread(s) per process)"


def finish(rows: list[dict], args, errors: list[str], show: bool = True) -> str:
    rows.sort(key=lambda r: (r["world_size"], r["layout"] != "fsdp", r["layout"]))
    add_scaling(rows)
    d, kv, h = shapes(args)
    numel = rows[0]["numel"] if rows else 0
    meta = (
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"{machine_text(args)}; "
        f"{args.layers} Llama-3-8B layers"
        + (f" with every dim / {args.dim_div}" if args.dim_div != 1 else "")
        + f" (wq/wo {d}x{d}, wk/wv {kv}x{d}, w1/w3 {h}x{d}, w2 {d}x{h}; {numel / 1e6:,.1f} M "
        f"params), {args.dtype} params and grads; MuonForeach, median of {args.steps} steps "
        f"after {args.warmup} warm-up (per step the slowest rank)"
    )
    text = table(rows, errors)
    if show:
        print(meta)
        print(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1))
    if args.results:
        section = "\n".join(
            [
                "## Scaling of the distributed Muon step (scripts/bench_scaling.py)",
                "",
                meta + ".",
                "",
                "N = 1 is the unsharded single-device step; speed-up = T(1) / T(N), efficiency "
                "= T(1) / (N T(N)) (target >= 85%). *fsdp*: `fully_shard` per layer, Shard(0) "
                "on a 1-D mesh; *fsdp x tp*: ColwiseParallel wq/wk/wv/w1/w3, RowwiseParallel "
                "wo/w2 on the inner mesh dim, FSDP on the outer. Bytes: what a rank sends per "
                "step (bf16 all-to-all, both directions) and the minimum for the same owners. "
                "`python scripts/bench_scaling.py --results RESULTS.md`",
                "",
                text,
            ]
        )
        write_section(args.results, "bench_scaling", section)
        print(f"wrote {args.results}")
    return text


def forwarded(argv: list[str]) -> list[str]:
    """The command-line options a worker needs (all but the driver's own)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--results", "--json", "--world-sizes", "--timeout", "--device"):
            skip = "=" not in a and i + 1 < len(argv)
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return worker(args)
    rows: list[dict] = []
    errors: list[str] = []
    sizes = world_sizes(args)
    for ws in sizes:
        print(f"[bench_scaling] N={ws} ...", flush=True)
        got, error = launch(ws, args, forwarded(argv))
        rows += got
        if error:
            errors.append(f"N={ws}: {error}")
        # After every N: a run cut short keeps what it measured.
        finish(rows, args, errors, show=ws == sizes[-1])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
