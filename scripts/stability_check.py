#!/usr/bin/env python
"""Does Muon train stably on every orthogonalization backend? The convergence model, side by side.

Trains the convergence benchmark's job (``configs/llama3_convergence.toml``: the 88M llama3 on
the local corpus) with Muon at one learning rate and schedule once per backend, all runs at
once (``--parallel``), and reports for each the last logged step, its loss and the first step
whose loss was not finite. The backends differ only in the path a matrix takes (Triton kernels,
Gram space, CUDA graphs; see README "Orthogonalization backends"), so a run that diverges where
the others train points at that path. The default is the case that diverged on one H100
(RESULTS.md): lr 4e-3 with a 150-step schedule, which the 2026-12-04 H200 runs trained through.

    python scripts/stability_check.py [--backends auto,eager,auto:no-gram,auto:no-triton]
        [--lr 4e-3] [--steps 150] [--seed 0] [--parallel 4] [--timeout 600] [--out DIR]
        [--dry-run] [-- extra job overrides]

Each run is ``scripts/train.sh`` with ``--optimizer.muon.backend B`` (``PYTHON`` and ``NPROC``
as train.sh takes them; data prepared once first, as the convergence benchmark does). Logs:
``OUT/<backend>/train.log``; the table also goes to ``OUT/stability.md``. Exit status 1 when a
run diverged or failed. ``--dry-run`` prints the command lines and runs nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/
from bench_convergence import CONFIG, parse_curves, prepare_data, split_extra  # noqa: E402
from bench_scaling import run_torchrun  # noqa: E402

BACKENDS = "auto,eager,auto:no-gram,auto:no-triton"


def run_dir(backend: str, args: argparse.Namespace) -> Path:
    """``backend``'s run folder (its dump folder, where its train.log goes too)."""
    return args.out / backend.replace(":", "_").replace(",", "_")


def command(backend: str, args: argparse.Namespace) -> list[str]:
    """The train.sh command line of ``backend``'s run."""
    dump = run_dir(backend, args)
    return [
        "bash", str(ROOT / "scripts" / "train.sh"), str(CONFIG),
        "--optimizer.name", "muon", "--optimizer.lr", f"{args.lr:g}",
        "--optimizer.muon.backend", backend, "--debug.seed", str(args.seed),
        "--training.steps", str(args.steps), "--validation.no-enable",
        "--metrics.log_freq", str(args.log_every), "--job.dump_folder", str(dump),
        *args.extra,
    ]  # fmt: skip


def verdict(backend: str, text: str, rc: int) -> dict:
    """One run's row: last logged step and loss, first non-finite step, status."""
    train, _, _ = parse_curves(text)
    diverged = next((s for s, loss in train if not math.isfinite(loss)), None)
    last = train[-1] if train else None
    if diverged is not None:
        status = f"diverged (non-finite loss from step {diverged})"
    elif rc != 0 or last is None:
        status = f"failed (exit {rc})"
    else:
        status = "trained"
    return {
        "backend": backend,
        "status": status,
        "last_step": last[0] if last else None,
        "last_loss": last[1] if last else None,
        "diverged_at": diverged,
    }


def table(rows: list[dict]) -> str:
    lines = ["| backend | status | last logged step | its loss |", "| --- | --- | --- | --- |"]
    for r in rows:
        loss = "-" if r["last_loss"] is None else f"{r['last_loss']:.4f}"
        lines.append(f"| {r['backend']} | {r['status']} | {r['last_step']} | {loss} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, extra = split_extra(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=BACKENDS, help=f"comma-separated (default {BACKENDS})")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--steps", type=int, default=150, help="the schedule's length (steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--parallel", type=int, default=4, help="runs launched at once")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "stability_check")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    args.extra = extra
    args.out = args.out.resolve()
    args.backends = [b for b in args.backends.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    commands = {b: command(b, args) for b in args.backends}
    if args.dry_run:
        for cmd in commands.values():
            print(" ".join(cmd))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_data()
    env = dict(os.environ, SKIP_PREPARE_DATA="1")

    def run(backend: str) -> dict:
        print(f"[stability_check] {backend}: {' '.join(commands[backend][2:])}", flush=True)
        text, rc = run_torchrun(commands[backend], args.timeout, cwd=ROOT, env=env)
        log = run_dir(backend, args) / "train.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
        return verdict(backend, text, rc)

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        rows = list(pool.map(run, args.backends))
    text = table(rows)
    (args.out / "stability.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["status"] == "trained" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
