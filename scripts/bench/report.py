"""What a run leaves: the facts of the run (date, device, versions, command, sizes), the
``--json`` file (every row, rewritten whole), and its section of RESULTS.md (only with
``--results``, between ``<!-- benchmark:start -->`` and ``<!-- benchmark:end -->``)."""

from __future__ import annotations

import datetime
import json
import math
import platform
import shlex
from pathlib import Path
from typing import Any

import torch
from results_md import markers, replace_section

import muon_plugin
from bench.config import Config
from bench.formatting import md_table, tf
from bench.tables import TABLES

MARK_START, MARK_END = markers("benchmark")

TITLES = {
    "kernels": "Symmetric Gram kernel vs cuBLAS (bf16)",
    "ortho": "Orthogonalization, 5 steps (FLOPs counted as plain matmuls; Gram-space runs fewer)",
    "step": "optimizer.step() (fp32 params and grads; the bf16 workload: bf16)",
    "memory": "Optimizer memory",
}
"""Each section's heading in RESULTS.md."""


def meta_info(args, device: torch.device, cfg: Config, argv: list[str]) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not importable"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu
        or f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "muon_plugin": getattr(muon_plugin, "__version__", "?"),
        "command": shlex.join(["python", *argv]),
        "sizes": "full" if cfg.full else f"small (matrix dims / {cfg.div})",
        "quick": args.quick,
    }


def markdown_section(meta: dict, results: dict[str, list[dict]], peak: dict | None) -> str:
    out = [
        MARK_START,
        "## Benchmark (`scripts/benchmark.py`)",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- torch {meta['torch']}, triton {meta['triton']}, Python {meta['python']}, "
        f"muon_plugin {meta['muon_plugin']}",
        f"- command: `{meta['command']}`",
        f"- sizes: {meta['sizes']}",
    ]
    if peak:
        out.append(
            f"- measured peak: {peak['name']} at {tf(peak['tflops'])} TFLOP/s ({peak['ms']:.3f} ms)"
        )
    out.append(
        "- times are medians; `optimizer.step()` is timed step by step after warm-up; "
        "ratios > 1 mean faster than the reference row"
    )
    if meta.get("runs", 1) > 1:
        out.append(
            f"- {meta['runs']} runs in separate processes: each figure is the median of the "
            "runs' figures, with their range in parentheses"
        )
    for key, table in TABLES.items():
        if key in results:
            h, body = table(results[key])
            out += ["", f"### {TITLES[key]}", "", md_table(h, body)]
    out += ["", MARK_END]
    return "\n".join(out) + "\n"


def write_results(path: Path, section: str) -> None:
    replace_section(path, section, MARK_START, MARK_END)


def clean_json(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    if isinstance(v, dict):
        return {k: clean_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [clean_json(x) for x in v]
    return v


def write_json(args, meta: dict, results: dict, peak) -> None:
    """All rows as ``--json`` keeps them (replaced whole, so a reader never sees half a file)."""
    rows = ([peak] if peak else []) + [r for s in args.sections for r in results.get(s, [])]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps(clean_json({"meta": meta, "rows": rows}), indent=1))
    tmp.replace(args.json)


def write_outputs(args, meta: dict, results: dict, peak, log) -> None:
    """The JSON rows (``--json``) and the RESULTS.md section (only with ``--results``)."""
    if args.json:
        write_json(args, meta, results, peak)
        log(f"wrote {args.json}")
    if args.results is not None:
        write_results(args.results, markdown_section(meta, results, peak))
        log(f"updated {args.results}")
