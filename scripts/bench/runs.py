"""Several runs as one report: ``--repeats N`` (N runs, each in its own process) and ``--merge``
(runs saved earlier with ``--json``), every figure the median of the runs with its range."""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.config import SECTIONS, make_config
from bench.report import write_outputs
from bench.summary import summary

SCRIPT = Path(__file__).resolve().parents[1] / "benchmark.py"
"""The command each repeated run is (``scripts/benchmark.py``)."""

RUN_KEYS = ("section", "workload", "shape", "kind", "name")
"""The fields that name a row (the same row in every run)."""


def child_command(raw_argv: list[str], json_path: Path) -> list[str]:
    """This run's command line without --repeats, --results and --json, writing ``json_path``."""
    out, skip = [], False
    for a in raw_argv[1:]:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--repeats", "--results", "--json"):
            skip = "=" not in a
            continue
        out.append(a)
    return [sys.executable, str(SCRIPT), *out, "--json", str(json_path)]


def aggregate(runs: list[list[dict]]) -> list[dict]:
    """One row per row of the runs: numbers are the median over the runs where the row has
    them, with ``<field>_range`` (min, max) and ``runs``; everything else from the first run."""
    merged: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            merged.setdefault(tuple(r.get(k) for k in RUN_KEYS), []).append(r)
    out = []
    for same in merged.values():
        row = dict(same[0])
        for key, value in same[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values = [r[key] for r in same if isinstance(r.get(key), (int, float))]
                row[key] = statistics.median(values)
                row[f"{key}_range"] = (min(values), max(values))
        row["runs"] = len(same)
        out.append(row)
    return out


def run_repeats(args, raw_argv: list[str]) -> int:
    """``--repeats N``: N runs in separate processes, then the medians and ranges."""
    datas, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            path = Path(tmp) / f"run{i}.json"
            print(f"\n===== run {i + 1} of {args.repeats} (its own process) =====", flush=True)
            rc = subprocess.run(child_command(raw_argv, path)).returncode
            status = status or rc
            if path.exists():
                datas.append(json.loads(path.read_text()))
    if not datas:
        print("benchmark: no run produced results", file=sys.stderr)
        return status or 1
    report_runs(args, shlex.join(["python", *raw_argv]), datas)
    return status


def report_runs(args, command: str, datas: list[dict]) -> None:
    """Summarize runs (each a ``--json`` file's content) as medians with their ranges."""
    rows = aggregate([d["rows"] for d in datas])
    metas = [d["meta"] for d in datas]
    meta = {**metas[0], "runs": len(datas), "command": command}
    meta["dates"] = [m["date"] for m in metas]
    cut = sum(bool(m.get("partial")) for m in metas)
    if cut:
        print(f"note: {cut} of the {len(metas)} runs stopped early (partial files)", flush=True)
        meta["partial_runs"] = cut
    sections = [s for s in SECTIONS if any(r.get("section") == s for r in rows)]
    results = {s: [r for r in rows if r.get("section") == s] for s in sections}
    peak = next((r for r in rows if r.get("section") == "peak"), None)
    cfg = make_config(bool(meta.get("gpu")), args.quick, False)
    print(summary(results, peak, meta, cfg), flush=True)
    args.sections = sections
    write_outputs(args, meta, results, peak, lambda msg: print(msg, flush=True))


def merge_runs(args) -> int:
    """``--merge A.json B.json ...``: report runs saved earlier with ``--json`` as one."""
    datas = []
    for path in args.merge:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"benchmark: --merge {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(data, dict) or not {"meta", "rows"} <= data.keys():
            print(f"benchmark: --merge {path}: not a benchmark --json file", file=sys.stderr)
            return 2
        datas.append(data)
    commands = sorted({d["meta"].get("command", "?") for d in datas})
    report_runs(args, " ; ".join(commands), datas)
    return 0
