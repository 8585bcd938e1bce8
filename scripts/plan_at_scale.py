#!/usr/bin/env python
"""The distributed plan at 8 to 4096 ranks, from the real planner, with a step-time model.

For Llama-3 8B / 70B / 405B, DeepSeek-V3 and Qwen3-30B-A3B (shapes from their published
configurations: ``scale_shapes.py``) laid out as torchtitan does (FSDP, FSDP x TP 8, HSDP,
expert parallelism), ``muon_plugin``'s own planner builds the plan on a simulated mesh, without
processes or devices (``scale_model.py``). Per configuration it reports the matrices each rank
owns, the Newton-Schulz FLOPs of the busiest and the mean rank (and the least imbalance whole
matrices allow), the bytes a rank sends and receives (and how much crosses nodes), the
collectives per step, the planning time and the planner's peak memory (each plan in a forked
process); then the cost model's step time beside AdamW's and a forward/backward, and what
microsoft/dion's Muon and torchtitan 0.3's DistMuon would do (``scale_peers.py``).

    python scripts/plan_at_scale.py [--quick] [--results RESULTS.md] [--doc docs/scale.md]
        [--json rows.json]

With ``--results`` / ``--doc`` the tables go between ``<!-- plan_at_scale:start -->`` and
``<!-- plan_at_scale:end -->`` of those files (appended when absent), with the date and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from results_md import write_section  # noqa: E402
from scale_model import Hardware, plan_at_scale, split_costs, step_costs  # noqa: E402
from scale_peers import dion, distmuon  # noqa: E402
from scale_shapes import HSDP_SHARD, MODELS, NODE, entries, local_fraction  # noqa: E402

from muon_plugin.orthogonalize import MatrixSpec  # noqa: E402

SPEC = MatrixSpec()  # Polar Express, 5 steps: what the FLOPs count
GIB = 2**30
CHILD_TIMEOUT_S = 600

FULL_GRID = [
    *[(m, "fsdp", n, 1) for m in ("llama3-8b", "llama3-70b", "llama3-405b")
      for n in (8, 64, 256, 1024, 4096)],
    *[(m, "fsdp_tp", n, 1) for m in ("llama3-8b", "llama3-70b", "llama3-405b")
      for n in (64, 1024, 4096)],
    *[(m, "hsdp", n, 1) for m in ("llama3-8b", "llama3-70b", "llama3-405b") for n in (256, 4096)],
    *[("deepseek-v3", "ep", n, ep) for n, ep in ((64, 8), (256, 8), (256, 64), (1024, 8),
                                                 (1024, 16), (1024, 32), (1024, 64), (4096, 64))],
    *[("qwen3-30b-a3b", "ep", n, 8) for n in (64, 256, 1024)],
    ("qwen3-30b-a3b", "fsdp", 1024, 1),
]  # fmt: skip
QUICK_GRID = [("llama3-8b", "fsdp", 8, 1), ("llama3-8b", "fsdp_tp", 64, 1),
              ("llama3-8b", "hsdp", 128, 1), ("qwen3-30b-a3b", "ep", 64, 8)]  # fmt: skip


def _vm(field: str) -> int:
    """``VmHWM`` / ``VmRSS`` of this process in bytes (Linux), or 0."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _plan_in_child(config: tuple, queue) -> None:
    """Plan one configuration; report the plan and the memory it took above the start."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) here
    except OSError:
        pass
    key, layout, n, ep = config
    start = _vm("VmRSS")
    plan = plan_at_scale(entries(MODELS[key](), layout, n, SPEC, ep), n)
    queue.put((plan, _vm("VmHWM") - start, _vm("VmHWM")))


def measure(config: tuple):
    """``(plan, planner peak bytes, process peak bytes)`` of one configuration, planned in a
    forked process (so that each peak is its own); in this process where fork is missing."""
    if "fork" not in mp.get_all_start_methods():
        key, layout, n, ep = config
        return plan_at_scale(entries(MODELS[key](), layout, n, SPEC, ep), n), 0, 0
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_plan_in_child, args=(config, queue))
    child.start()
    try:
        out = queue.get(timeout=CHILD_TIMEOUT_S)
    except Exception:
        child.kill()
        raise RuntimeError(f"planning {config} failed (exit code {child.exitcode})") from None
    child.join()
    return out


def mesh_of(layout: str, n: int, ep: int) -> str:
    return {
        "fsdp": f"{n}",
        "fsdp_tp": f"{n // NODE}x{NODE}",
        "hsdp": f"{n // HSDP_SHARD}x{HSDP_SHARD}",
        "ep": f"{n}; experts {n // ep}x{ep}",
    }[layout]


def run(grid: list[tuple], hw: Hardware) -> list[dict]:
    rows = []
    flops = SPEC.flops
    plan_at_scale(entries(MODELS["llama3-8b"](), "fsdp", 2, SPEC), 2)  # imports done here
    for config in grid:
        key, layout, n, ep = config
        model = MODELS[key]()
        plan, planner_bytes, peak_bytes = measure(config)
        costs = step_costs(plan, model, local_fraction(layout, n), hw)
        rows.append(
            {
                "model": model.name, "layout": layout if layout != "ep" else f"ep {ep}",
                "ranks": n, "ep": ep,
                "mesh": mesh_of(layout, n, ep), "plan": plan, "costs": costs,
                "planner_mib": planner_bytes / 2**20, "peak_mib": peak_bytes / 2**20,
                "dion": dion(model, layout, n, ep, flops),
                "distmuon": distmuon(model, layout, n, ep, flops),
                "params": model.params, "active": model.active_params,
            }
        )  # fmt: skip
        print(f"{model.name:>15} {layout:>7} {n:>5} ep {ep:>2}: plan {plan.plan_seconds:.2f} s, "
              f"max/mean {plan.imbalance:.3f} (bound {plan.imbalance_bound:.3f}), "
              f"Muon {costs.muon * 1e3:.1f} ms", flush=True)  # fmt: skip
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def tables(rows: list[dict], hw: Hardware) -> str:
    """The plan, cost and peers tables as Markdown."""
    out = ["### The plan per rank (real planner, simulated mesh)", ""]
    out += [
        "| model | layout | ranks | mesh | matrices | owned per rank | TFLOP busiest / mean "
        "| max / mean (least possible) | sent / received per rank, GiB | across nodes "
        "| collectives | plan s | planner MiB (process) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p = r["plan"]
        sent, recv = max(p.sent), max(p.received)
        inter = sum(p.sent_inter) / sum(p.sent) if sum(p.sent) else 0.0
        out.append(
            f"| {r['model']} | {r['layout']} | {p.ranks} | {r['mesh']} | {p.matrices} "
            f"| {min(p.matrices_per_rank)}-{max(p.matrices_per_rank)} "
            f"| {p.max_flops / 1e12:.1f} / {p.mean_flops / 1e12:.1f} "
            f"| {p.imbalance:.3f} ({p.imbalance_bound:.3f}) "
            f"| {sent / GIB:.2f} / {recv / GIB:.2f} | {inter:.0%} | {p.collectives} "
            f"| {p.plan_seconds:.2f} | {r['planner_mib']:.0f} ({r['peak_mib']:.0f}) |"
        )
    out += ["", "### Step time (cost model, ms; busiest rank)", ""]
    out += [
        "| model | layout | ranks | orthogonalize | one largest matrix | traffic | Muon step "
        "| AdamW step | forward + backward | Muon - AdamW, % of the step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        c = r["costs"]
        extra = (c.muon - c.adamw) / (c.forward_backward + c.adamw)
        out.append(
            f"| {r['model']} | {r['layout']} | {r['ranks']} | {_ms(c.orthogonalize)} "
            f"| {_ms(c.largest_matrix)} | {_ms(c.communicate)} | {_ms(c.muon)} "
            f"| {_ms(c.adamw)} | {_ms(c.forward_backward)} | {extra:.2%} |"
        )
    out += ["", "### Beside microsoft/dion and torchtitan 0.3 DistMuon (busiest rank, a step)"]
    out += [""]
    out += [
        "| model | layout | ranks | ours: TFLOP / sent GiB / collectives "
        "| dion Muon | torchtitan 0.3 DistMuon |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p = r["plan"]
        ours = f"{p.max_flops / 1e12:.1f} / {max(p.sent) / GIB:.2f} / {p.collectives}"
        out.append(
            f"| {r['model']} | {r['layout']} | {r['ranks']} | {ours} "
            f"| {_peer(r['dion'])} | {_peer(r['distmuon'])} |"
        )
    return "\n".join(out)


def issue_figures(hw: Hardware) -> str:
    """One largest matrix of Llama-3 70B and 405B: its time, and its share of a step."""
    out = [
        "### One largest matrix (5 steps) and the step it sits in", "",
        "| matrix | TFLOP | ms at the measured rate | ms at the bf16 matmul rate "
        "| share of forward + backward at 1024 / 4096 GPUs |",
        "| --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for key, shape in (("llama3-70b", (28672, 8192)), ("llama3-405b", (53248, 16384))):
        model = MODELS[key]()
        f = SPEC.flops(shape)
        fast, slow = f / hw.orth_flops, f / hw.matmul_flops
        shares = []
        for n in (1024, 4096):
            step = 6 * model.active_params * hw.tokens / (n * hw.peak_bf16 * hw.mfu)
            shares.append(f"{fast / step:.1%}-{slow / step:.1%}")
        out.append(
            f"| {model.name} {shape[1]} x {shape[0]} | {f / 1e12:.1f} | {fast * 1e3:.0f} "
            f"| {slow * 1e3:.0f} | {' / '.join(shares)} |"
        )
    return "\n".join(out)


def split_table(hw: Hardware) -> str:
    """The largest matrices with their iteration split over the 8 GPUs of a node."""
    out = [
        f"### One largest matrix split over the {NODE} GPUs of a node (ms per rank, 5 steps)",
        "",
        "| matrix | variant | compute | traffic (NVLink) | total |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, shape in (("Llama-3 70B w1", (28672, 8192)), ("Llama-3.1 405B w1", (53248, 16384)),
                        ("DeepSeek-V3 dense w1", (18432, 7168))):  # fmt: skip
        for c in split_costs(shape, NODE, SPEC.steps, hw):
            out.append(
                f"| {name} | {c.variant} | {_ms(c.compute)} | {_ms(c.traffic)} | {_ms(c.total)} |"
            )
    return "\n".join(out)


def _peer(step) -> str:
    if step.refused:
        return step.refused
    return f"{step.flops / 1e12:.1f} / {step.sent / GIB:.2f} / {step.collectives}"


def section(rows: list[dict], hw: Hardware, command: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## The plan at scale (scripts/plan_at_scale.py)",
        "",
        f"{now}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {_cpus()} CPUs; `{command}`. No GPU and no process group: "
        "the plans are the planner's, the times are the cost model's (rates below).",
        "",
        f"Rates: orthogonalization {hw.orth_flops / 1e12:.0f} TFLOP/s (FLOPs as the plan counts "
        f"them), Muon elementwise {hw.muon_elementwise / 1e9:.1f} G params/s, fused AdamW "
        f"{hw.adamw / 1e9:.1f} G params/s (all three measured on one H100); NVLink "
        f"{hw.nvlink / 1e9:.0f} GB/s and InfiniBand {hw.infiniband / 1e9:.0f} GB/s per GPU and "
        f"direction, {NODE} GPUs a node; forward + backward 6 x active parameters x "
        f"{hw.tokens:,} tokens at {hw.mfu:.0%} of {hw.peak_bf16 / 1e12:.0f} TFLOP/s; "
        f"bf16 matmul rate {hw.matmul_flops / 1e12:.0f} TFLOP/s. Orthogonalization and traffic "
        'are added (no overlap). "least possible": a lower bound on max / mean for whole '
        "matrices that stay where only one rank holds them whole (not always reachable).",
        "",
        tables(rows, hw),
        "",
        issue_figures(hw),
        "",
        split_table(hw),
    ]
    return "\n".join(lines)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    ap.add_argument("--results", help="write the tables into this RESULTS.md")
    ap.add_argument("--doc", help="write the tables into this page too")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args(argv)
    hw = Hardware()
    rows = run(QUICK_GRID if args.quick else FULL_GRID, hw)
    command = "python scripts/plan_at_scale.py" + (" --quick" if args.quick else "")
    body = section(rows, hw, command)
    print(body)
    for path in (args.results, args.doc):
        if path:
            write_section(path, "plan_at_scale", body)
    if args.json:
        data = [
            {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in r.items()}
            for r in rows
        ]
        Path(args.json).write_text(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
