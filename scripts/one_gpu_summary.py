#!/usr/bin/env python
"""The closing summary of ``scripts/run_one_gpu.sh``: one block per phase that ran.

    python scripts/one_gpu_summary.py OUT      # prints it and writes OUT/summary.txt

Each phase is PASS, FAIL or CUT (stopped by its time limit), with its time and limit, where its
logs are and its key numbers: the tests' pytest line; the training run's steps, first and last
loss and tokens/s; the benchmark's rows with a number per section (every row that is not a
peer library's must have one; a peer that is not installed is listed, not failed) and the
``optimizer.step()`` times of MuonForeach, torch.optim.Muon and fused AdamW per workload; the
compiled row's times. A phase whose logs show a Triton kernel falling back to torch ops (its
one warning) fails, naming the kernel. It reads only what the phases left in OUT
(``phases.tsv``: name, exit status, seconds, limit; the logs; the benchmark's ``--json``
files).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SECTIONS = ("kernels", "ortho", "step", "memory")
KEY_ROWS = ("MuonForeach (polar_express)", "torch.optim.Muon", "AdamW(fused=True)")
NUMBER = {"kernels": "gram_ms", "ortho": "ms", "step": "ms", "memory": "state_mib"}
"""The field that holds a section's number."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TIMED_OUT = (124, 137)  # timeout(1): the limit was reached (TERM, then KILL)
NOT_RUN = -1  # run_one_gpu.sh: the phase did not start, too little of TOTAL_S was left


def phases(out: Path) -> list[tuple[str, int, int, int]]:
    """``(name, exit status, seconds, limit)`` of each phase, in the order they ran."""
    path = out / "phases.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, rc, seconds, limit = line.split("\t")
        rows.append((name, int(rc), int(seconds), int(limit)))
    return rows


def verdict(rc: int, ok: bool) -> str:
    if rc in TIMED_OUT:
        return "CUT"
    return "PASS" if rc == 0 and ok else "FAIL"


def read(path: Path) -> str:
    return ANSI.sub("", path.read_text(errors="replace")) if path.is_file() else ""


def tests_part(out: Path, rc: int) -> tuple[str, list[str]]:
    found = re.findall(r"^=*\s*(\d+ \w+.* in [\d.]+s\b.*?)\s*=*$", read(out / "tests.log"), re.M)
    line = found[-1] if found else "no pytest result line"
    return verdict(rc, bool(found)), [line, f"log: {out / 'tests.log'}"]


def train_part(out: Path, rc: int) -> tuple[str, list[str]]:
    text = read(out / "train.log")
    losses = {int(s): float(v) for s, v in re.findall(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)", text)}
    summary = re.search(r"Run summary: (\d+) logged steps", text)
    tps = re.search(r"throughput: ([\d,]+) tokens/s", text)
    lines = []
    if losses:
        first, last = min(losses), max(losses)
        lines.append(
            f"steps {first}-{last} logged, loss {losses[first]:.3f} -> {losses[last]:.3f}"
            + (f", {tps.group(1)} tokens/s" if tps else "")
        )
    else:
        lines.append("no training step logged")
    data = [ln for ln in text.splitlines() if ln.startswith(("[train] data", "[prepare_data]"))]
    lines += data[:3]
    lines.append(
        f"log: {out / 'train.log'}"
        + (", run logs: train_logs/" if (out / "train_logs").is_dir() else "")
    )
    return verdict(rc, bool(summary)), lines


def load(path: Path) -> dict:
    """A benchmark ``--json`` file (empty when missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_rows(path: Path) -> list[dict]:
    rows = load(path).get("rows")
    return rows if isinstance(rows, list) else []


def left_out(r: dict, gpu: bool) -> bool:
    """A row skipped by choice: a peer library (not installed, or the peers phase's), the
    compiled row under ``--no-compile`` (the compile phase times it), or, in a run without a
    GPU (``SMOKE=1``), a row that needs one."""
    if "skipped" not in r:
        return False
    return (
        r.get("group") == "peer"
        or r["skipped"] == "--no-compile"
        or (not gpu and "GPU" in r["skipped"])
    )


def missing_numbers(rows: list[dict], gpu: bool) -> tuple[list[str], list[str]]:
    """(rows that should have a number and have none, rows left out by choice), as text."""
    bad, out = [], []
    for r in rows:
        section = r.get("section")
        if section not in NUMBER or r.get(NUMBER[section]) is not None:
            continue
        reason = r.get("error") or r.get("skipped") or "no number"
        if left_out(r, gpu):
            out.append(f"{r.get('name')} ({reason})")
        elif section != "memory" or "error" in r:  # a skipped row's memory entry: see step
            where = " ".join(str(r[k]) for k in ("workload", "kind", "shape") if r.get(k))
            bad.append(f"{section}: {r.get('name', '')} {where}: {reason}")
    return bad, sorted(set(out))


def counts(rows: list[dict]) -> str:
    parts = []
    for section in SECTIONS:
        got = [r for r in rows if r.get("section") == section]
        if got:
            n = sum(r.get(NUMBER[section]) is not None for r in got)
            parts.append(f"{section} {n}/{len(got)}")
    return ", ".join(parts) + " rows with a number"


def key_numbers(rows: list[dict]) -> list[str]:
    lines = []
    workloads = dict.fromkeys(r["workload"] for r in rows if r.get("section") == "step")
    for wl in workloads:
        got = {
            r["name"]: r.get("ms")
            for r in rows
            if r.get("section") == "step" and r["workload"] == wl
        }
        shown = [f"{name} {got[name]:.3f}" for name in KEY_ROWS if got.get(name) is not None]
        if shown:
            lines.append(f"{wl}: step ms " + ", ".join(shown))
    return lines


def bench_part(out: Path, rc: int, later: list[dict]) -> tuple[str, list[str]]:
    """``later``: rows that later phases measured (the compiled row), counted as numbers."""
    files = [out / "bench.json"] + sorted(out.glob("bench[0-9]*.json"))
    data = next((d for d in map(load, files) if d.get("rows")), {})
    rows = data.get("rows", [])
    timed_later = {(r.get("workload"), r.get("name")): r for r in later if r.get("ms") is not None}
    rows = [
        timed_later.get((r.get("workload"), r.get("name")), r) if r.get("section") == "step" else r
        for r in rows
    ]
    bad, out_by_choice = missing_numbers(rows, gpu=bool(data.get("meta", {}).get("gpu")))
    lines = [counts(rows)] if rows else ["no benchmark rows"]
    lines += [f"WITHOUT A NUMBER: {b}" for b in bad]
    if out_by_choice:
        lines.append("left out: " + ", ".join(out_by_choice))
    lines += key_numbers(rows)
    logs = sorted(p.name for p in out.glob("bench[0-9]*.log"))
    lines.append("logs: " + ", ".join(logs + ["bench.txt"]))
    return verdict(rc, bool(rows) and not bad), lines


def compile_part(out: Path, rc: int) -> tuple[str, list[str], list[dict]]:
    rows = [r for r in load_rows(out / "compile.json") if r.get("section") == "step"]
    timed = [r for r in rows if r.get("ms") is not None]
    lines = [f"{r['workload']}: {r['name']} {r['ms']:.3f} ms" for r in timed]
    lines += [
        f"WITHOUT A NUMBER: {r['workload']}: {r.get('error') or r.get('skipped')}"
        for r in rows
        if r not in timed
    ]
    lines.append(f"log: {out / 'compile.log'}")
    return verdict(rc, bool(timed) and len(timed) == len(rows)), lines, timed


FALLBACK = re.compile(r"muon_plugin: the (.+?) failed \((\w+)")
"""The one warning of a Triton kernel that failed to build or launch (the torch ops took over)."""


def fallbacks(out: Path, phase: str) -> list[str]:
    """The kernels that fell back to torch ops in a phase's logs (``<phase>*.log``), each once.
    The results stay right, so the phase itself passes; the check of a GPU machine does not."""
    found: dict[str, str] = {}
    for log in sorted(out.glob(f"{phase}*.log")):
        for kernel, error in FALLBACK.findall(read(log)):
            found.setdefault(
                kernel, f"KERNEL FELL BACK TO TORCH OPS: the {kernel} ({error}, {log.name})"
            )
    return list(found.values())


def summary(out: Path) -> tuple[str, bool]:
    """The summary text, and whether every phase passed."""
    ran = phases(out)
    machine = read(out / "machine.txt").strip().splitlines()
    total = sum(seconds for _, _, seconds, _ in ran)
    lines = [f"run_one_gpu summary: {out} ({total} s of phases)"]
    lines += [f"  machine: {ln}" for ln in machine]
    compiled: list[dict] = []
    for name, rc, _, _ in ran:  # the compiled rows first: the bench part counts them
        if name == "compile":
            compiled = compile_part(out, rc)[2]
    all_ok = bool(ran)
    for name, rc, seconds, limit in ran:
        if name == "tests":
            status, detail = tests_part(out, rc)
        elif name == "train":
            status, detail = train_part(out, rc)
        elif name == "bench":
            status, detail = bench_part(out, rc, compiled)
        elif name == "compile":
            status, detail, _ = compile_part(out, rc)
        else:  # peers, spectrum, stability, tune: their exit status and log
            status, detail = verdict(rc, True), [f"log: {out / (name + '.log')}"]
        fell_back = fallbacks(out, name)
        if fell_back and status == "PASS":
            status = "FAIL"
        detail = fell_back + detail
        if rc == NOT_RUN:
            status, detail = "NOT RUN", ["no time left within TOTAL_S"]
        all_ok &= status == "PASS"
        lines.append(f"  {name:<8} {status:<4}  {seconds} s of {limit} (exit {rc})")
        lines += [f"           {d}" for d in detail]
    return "\n".join(lines) + "\n", all_ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip())
        return 2
    out = Path(argv[0])
    text, ok = summary(out)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
