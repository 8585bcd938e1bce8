#!/usr/bin/env python
"""Communication of the distributed orthogonalization: bytes per rank per step, and step time.

For a fixed set of matrices (``--layers`` Llama-like layers of width ``--dim``: wq, wk, wv, wo,
w1, w2, w3, plus two MoE-style expert stacks ``[E, m, n]``), each layout is built with the real
APIs (``fully_shard``, ``parallelize_module``, ``distribute_tensor``) in gloo CPU processes at
world sizes 1, 2 and 4, and ``MuonForeach.step()`` is run. Per layout it reports

- bytes each rank actually sent per step (sizes of the all-to-all buffers), mean and max;
- the minimum for the same owners: every distinct shard sent once to its owner, and every
  holder's piece of the result sent back once (computed from the layout alone, see
  ``minimum_bytes``), and the ratio;
- for comparison, what the all-gather approach receives per rank (every rank gathers every
  whole matrix and orthogonalizes it redundantly);
- collective calls per step, matrices per rank (min-max), and the median ``step()`` time;
- the median time of the ranks' per-step agreement check within it (one small all-reduce per
  rank set, read on the host: ``muon_plugin.distributed.agreement``).

    python scripts/bench_comm.py [--world-sizes 1,2,4] [--dim 128] [--layers 4]
        [--steps 5] [--results RESULTS.md] [--json rows.json]

With ``--results`` the table is written into RESULTS.md between
``<!-- bench_comm:start -->`` and ``<!-- bench_comm:end -->`` (appended when absent) with the
date, torch version and machine. Timings on a small CPU machine with several processes per
core are contended: they show relative costs, not GPU speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for results_md
from results_md import write_section  # noqa: E402
from torch import nn  # noqa: E402

WIRE_BYTES = 2


# ---------------------------------------------------------------------- the matrices


class Layer(nn.Module):
    def __init__(self, d: int, kv: int, h: int) -> None:
        super().__init__()
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv, bias=False)
        self.wv = nn.Linear(d, kv, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)


class Experts(nn.Module):
    def __init__(self, e: int, d: int, h: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, h, d) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e, d, h) * 0.02)


def dense_model(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Layer(dim, dim // 4, 3 * dim) for _ in range(layers)))


TP_PLAN_NAMES = {"wq": "col", "wk": "col", "wv": "col", "w1": "col", "w3": "col"}


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {n: ColwiseParallel() if TP_PLAN_NAMES.get(n) else RowwiseParallel() for n in
            ("wq", "wk", "wv", "wo", "w1", "w2", "w3")}  # fmt: skip


def layouts_for(ws: int) -> list[str]:
    if ws == 1:
        return ["single", "experts"]
    out = ["fsdp", "tp", "replicate", "ddp", "experts"]
    if ws >= 4 and ws % 2 == 0:
        out[2:2] = ["fsdp x tp", "hsdp"]
    return out


SHARDED_LAYOUTS = ("fsdp", "tp", "fsdp x tp", "hsdp")


def shard_layers(
    model: nn.Sequential, layout: str, ws: int, device_type: str = "cpu", tp: int = 2
) -> None:
    """Lay the layers of ``model`` out as ``layout`` (one of SHARDED_LAYOUTS) on ``ws`` ranks.

    The real APIs, as torchtitan uses them: ``fully_shard`` per layer (FSDP: Shard(0) on a
    1-D mesh), ``parallelize_module`` (TP), TP on a ``tp``-wide inner mesh dim then FSDP on the
    outer one, or HSDP (Replicate x Shard(0)). Works on a meta-device model too.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if layout == "fsdp":
        mesh = init_device_mesh(device_type, (ws,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh(device_type, (ws,))
        for layer in model:
            parallelize_module(layer, mesh, tp_plan())
    elif layout == "fsdp x tp":
        mesh = init_device_mesh(device_type, (ws // tp, tp), mesh_dim_names=("dp", "tp"))
        for layer in model:
            parallelize_module(layer, mesh["tp"], tp_plan())
            fully_shard(layer, mesh=mesh["dp"])
    elif layout == "hsdp":
        mesh = init_device_mesh(device_type, (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            fully_shard(layer, mesh=mesh)
    else:
        raise ValueError(f"not a sharded layout: {layout!r}")


def build(layout: str, ws: int, dim: int, layers: int):
    """(named Muon params, replicate_group) of ``layout`` on ``ws`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    group = None
    if layout == "experts":
        torch.manual_seed(1)
        model = nn.Sequential(*(Experts(2 * max(ws, 4), dim // 2, dim) for _ in range(layers)))
        if ws > 1:
            fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))  # Shard(0): expert dim
        return list(model.named_parameters()), group
    model = dense_model(dim, layers)
    if layout in SHARDED_LAYOUTS:
        shard_layers(model, layout, ws)
    elif layout == "replicate":
        mesh = init_device_mesh("cpu", (ws,))
        named = [
            (n, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
            for n, p in model.named_parameters()
        ]
        return named, group
    elif layout == "ddp":
        group = dist.group.WORLD
    elif layout != "single":
        raise ValueError(layout)
    return list(model.named_parameters()), group


# ---------------------------------------------------------------------- byte accounting


def minimum_bytes(plan) -> tuple[int, int]:
    """(total bytes for the plan's owners, lower bound over all owner choices), from layouts.

    For a whole matrix with owner ``o``: every element ``o`` does not hold crosses the network
    once towards ``o``, and every other holder's piece of the result once back.
    """
    total = bound = 0
    for g in plan.groups:
        layout = g.layout
        unit = math.prod(g.unit_shape)
        for (_, b), owner in zip(g.units, g.owners, strict=True):
            held = []
            for j in range(layout.num_ranks):
                has_batch = all(
                    layout.index[d][j].position(bd) is not None
                    for d, bd in zip(g.batch_dims, b, strict=True)
                )
                n = math.prod(layout.index[d][j].size for d in g.unit_dims) if has_batch else 0
                held.append(n)

            def cost(o: int, held=held, unit=unit) -> int:
                return (unit - held[o]) + sum(h for j, h in enumerate(held) if j != o)

            total += cost(owner) * WIRE_BYTES
            bound += min(cost(o) for o in range(layout.num_ranks)) * WIRE_BYTES
    return total, bound


def allgather_bytes_per_rank(plan) -> float:
    """Mean bytes a rank receives when every rank gathers every whole matrix."""
    out = 0.0
    for g in plan.groups:
        layout = g.layout
        n = layout.num_ranks
        unit = math.prod(g.unit_shape)
        for _, b in g.units:
            for j in range(n):
                has_batch = all(
                    layout.index[d][j].position(bd) is not None
                    for d, bd in zip(g.batch_dims, b, strict=True)
                )
                held = math.prod(layout.index[d][j].size for d in g.unit_dims) if has_batch else 0
                out += (unit - held) * WIRE_BYTES / n
    return out


def traffic(plan, stats: list[dict]) -> dict:
    """Matrices and bytes of ``plan`` given every rank's ``plan.last_stats`` (rank order)."""
    from muon_plugin.distributed.report import totals_per_rank

    ws = len(stats)
    report = plan.report()
    sent = [s["send_bytes"] for s in stats]
    received = [s["recv_bytes"] for s in stats]
    total, bound = minimum_bytes(plan)
    per_rank = totals_per_rank(report)
    return {
        "matrices": sum(row["matrices"] for row in report),
        "matrices_per_rank": [per_rank[r]["matrices"] if r in per_rank else 0 for r in range(ws)],
        "sent_mean": statistics.mean(sent),
        "sent_max": max(sent),
        "received_max": max(received),
        "minimum_mean": total / ws,
        "lower_bound_mean": bound / ws,
        "allgather_recv_mean": allgather_bytes_per_rank(plan),
        "collectives": stats[0]["collectives"],
    }


# ---------------------------------------------------------------------- workers


def worker(rank: int, ws: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=300),
    )
    from muon_plugin import MuonForeach

    rows = []
    try:
        for layout in layouts_for(ws):
            named, group = build(layout, ws, args.dim, args.layers)
            opt = MuonForeach([p for _, p in named], lr=0.01, replicate_group=group)
            gen = torch.Generator().manual_seed(0)
            for _, p in named:
                p.grad = torch.zeros_like(p)
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                local.copy_(torch.randn(local.shape, generator=gen))
            times = []
            for step in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                if step >= args.warmup:
                    times.append(dt)
            plan = opt._plan
            stats = dict(plan.last_stats)
            checks = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                opt._prepared.agreement.verify()
                checks.append(time.perf_counter() - t0)
            gathered = [None] * ws
            dist.all_gather_object(gathered, (stats, statistics.median(times)))
            check_times: list = [None] * ws
            dist.all_gather_object(check_times, statistics.median(checks))
            if rank == 0:
                rows.append(
                    {
                        "world_size": ws,
                        "layout": layout,
                        "params": len(named),
                        **traffic(plan, [s for s, _ in gathered]),
                        "step_ms": statistics.median(t for _, t in gathered) * 1e3,
                        "step_ms_max_rank": max(t for _, t in gathered) * 1e3,
                        "check_ms": statistics.median(check_times) * 1e3,
                    }
                )
            del opt, named
            dist.barrier()
    finally:
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown() -> NoReturn:
    """Leave a worker whose work is done and reported, skipping the interpreter's teardown.

    gloo's background threads can make that teardown abort ("terminate called without an
    active exception", SIGABRT) on a loaded machine, which would fail the run after the fact.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(ws: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(
            worker,
            args=(ws, free_port(), args, out),
            nprocs=ws,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(out).read_text())


# ---------------------------------------------------------------------- output


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def table(rows: list[dict]) -> str:
    header = (
        "| world | layout | matrices | per rank | sent/rank KiB (mean / max) | minimum KiB | "
        "sent / minimum | all-gather recv/rank KiB | collectives | step ms | rank check ms |"
    )
    lines = [header, "|" + " --- |" * 11]
    for r in rows:
        per_rank = r["matrices_per_rank"]
        ratio = r["sent_mean"] / r["minimum_mean"] if r["minimum_mean"] else float("nan")
        ratio_text = f"{ratio:.2f}" if r["minimum_mean"] else ("-" if not r["sent_mean"] else "?")
        lines.append(
            f"| {r['world_size']} | {r['layout']} | {r['matrices']} | "
            f"{min(per_rank)}-{max(per_rank)} | {kib(r['sent_mean'])} / {kib(r['sent_max'])} | "
            f"{kib(r['minimum_mean'])} | {ratio_text} | {kib(r['allgather_recv_mean'])} | "
            f"{r['collectives']} | {r['step_ms']:.1f} | {r['check_ms']:.3f} |"
        )
    return "\n".join(lines)


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (1: no oversubscription)"
    )
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for ws in (int(w) for w in args.world_sizes.split(",") if w):
        rows += run_world(ws, args)
    text = table(rows)
    meta = (
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {machine()}; "
        f"{args.layers} layers of dim {args.dim} (7 matrices each) and {args.layers} x 2 "
        f"expert stacks; MuonForeach, gloo, {args.threads} thread(s) per process, median of "
        f"{args.steps} steps after {args.warmup} warm-up"
    )
    print(meta)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.results:
        section = "\n".join(
            [
                "## Distributed orthogonalization traffic (scripts/bench_comm.py)",
                "",
                meta + ".",
                "",
                "Bytes are what each rank sends per `step()` (bf16 all-to-all buffers, both "
                "directions); *minimum* is every distinct shard sent once to its owner and each "
                "holder's result piece once back, for the same owners; *all-gather* is what a "
                "rank receives when every rank rebuilds every whole matrix (the redundant "
                "approach); *rank check* is the part of the step in which the ranks verify "
                "that they give the same parameters (one all-reduce of 64 bytes per mesh). "
                "`python scripts/bench_comm.py --results RESULTS.md`",
                "",
                text,
            ]
        )
        write_section(args.results, "bench_comm", section)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
