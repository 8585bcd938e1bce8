"""The command line of ``scripts/benchmark.py``: its options, the sections of one run in order,
the printed tables and the exit status (non-zero when a required row fails)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from bench.config import SECTIONS, WORKLOADS, Config, Selection, make_config
from bench.formatting import text_table, tf
from bench.kernels import section_kernels
from bench.measure import Timer, measure_peak
from bench.ortho import section_ortho
from bench.report import meta_info, write_json, write_outputs
from bench.runs import merge_runs, run_repeats
from bench.step import section_step
from bench.summary import summary
from bench.tables import TABLES

DESCRIPTION = (
    "Benchmark muon_plugin: symmetric kernels, the orthogonalization loop, optimizer.step(), "
    "memory."
)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="markdown file whose benchmark section is created/updated (e.g. RESULTS.md); "
        "without it nothing is written",
    )
    p.add_argument("--json", type=Path, help="write all rows to this JSON file")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the benchmark this many times, each in its own process, and report every "
        "figure as the median of the runs with their range",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: report the runs saved with --json (separate processes, machines "
        "starts or days) as medians with their ranges",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--rows",
        default="",
        help="step and memory sections: only the rows whose name contains one of these "
        "comma-separated words (case-insensitive), e.g. 'MuonForeach (polar,MuonLP (int8'",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"step and memory sections: a comma-separated subset of {','.join(WORKLOADS)}",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new step row after this many seconds (later rows are marked skipped); "
        "with --json the file is rewritten after every row, so a run stopped from outside "
        "still leaves what it measured",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="also time MuonForeach(compile=True) on small runs",
    )
    g.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="skip the MuonForeach(compile=True) row",
    )
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    args.sections = [s for s in SECTIONS if s in sections]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or set(workloads) - set(WORKLOADS):
        p.error(f"--workloads {args.workloads!r}: choose from {','.join(WORKLOADS)}")
    args.workloads = tuple(w for w in WORKLOADS if w in workloads)
    args.rows = tuple(r.strip().lower() for r in args.rows.split(",") if r.strip())
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget {args.budget}: must be a positive number of seconds")
    return args


def run_sections(args, cfg: Config, device: torch.device, timer, peak, log, saved) -> dict:
    """The rows of every section asked for, each timed and logged; ``saved(results)`` after
    every step row, with everything measured so far."""
    results: dict[str, list[dict]] = {}

    def saved_step_rows(step_rows: list[dict], mem_rows: list[dict]) -> None:
        partial = dict(results)
        for key, rows in (("step", step_rows), ("memory", mem_rows)):
            if key in args.sections:
                partial[key] = rows
        saved(partial)

    def timed_section(name: str, fn):
        t0 = time.perf_counter()
        log(f"\n[{name}]")
        out = fn()
        log(f"  ({name}: {time.perf_counter() - t0:.1f} s)")
        return out

    if "kernels" in args.sections:
        results["kernels"] = timed_section(
            "kernels", lambda: section_kernels(cfg, device, timer, log)
        )
    if "ortho" in args.sections:
        results["ortho"] = timed_section(
            "ortho", lambda: section_ortho(cfg, device, timer, peak, log)
        )
    if "step" in args.sections or "memory" in args.sections:
        name = "+".join(s for s in ("step", "memory") if s in args.sections)
        step_rows, mem_rows = timed_section(
            name,
            lambda: section_step(
                cfg,
                device,
                timer,
                peak,
                "step" in args.sections,
                "memory" in args.sections,
                log,
                saved_step_rows,
            ),
        )
        for key, rows in (("step", step_rows), ("memory", mem_rows)):
            if key in args.sections:
                results[key] = rows
    return results


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv if argv is None else ["scripts/benchmark.py", *argv]
    args = parse_args(argv)
    if args.merge:
        return merge_runs(args)
    if args.repeats > 1:
        return run_repeats(args, raw_argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmark: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t_start = time.perf_counter()
    select = Selection(
        args.rows, args.workloads, None if args.budget is None else t_start + args.budget
    )
    cfg = dataclasses.replace(make_config(cuda, args.quick, args.compile), select=select)
    timer = Timer(device)
    meta = meta_info(args, device, cfg, raw_argv)
    torch.manual_seed(0)

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(
        f"benchmark: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"sizes {meta['sizes']}, sections {','.join(args.sections)}"
    )
    peak = None
    if "ortho" in args.sections or "step" in args.sections:
        peak = measure_peak(cfg, device, timer)
        log(f"peak: {peak['name']}: {peak['ms']:.3f} ms, {tf(peak['tflops'])} TFLOP/s")

    def saved(partial: dict) -> None:
        if args.json:
            write_json(args, {**meta, "partial": True}, partial, peak)

    results = run_sections(args, cfg, device, timer, peak, log, saved)
    meta["total_s"] = time.perf_counter() - t_start
    write_outputs(args, meta, results, peak, log)
    for key, table in TABLES.items():
        if key in results:
            log(f"\n{key}:")
            log(text_table(*table(results[key])))
    log(summary(results, peak, meta, cfg))
    failures = [
        r
        for s in results.values()
        for r in s
        if "error" in r and (r.get("required") or r.get("section") in ("kernels", "ortho"))
    ]
    log(f"total {meta['total_s']:.1f} s" + (f"; {len(failures)} FAILED rows" if failures else ""))
    return 1 if failures else 0
