#!/usr/bin/env python
"""Convergence benchmark: AdamW vs Muon vs NorMuon vs MuonLP, real torchtitan runs on the local
corpus.

Every run is ``scripts/train.sh configs/llama3_convergence.toml`` (same model, data order,
batch, sequence length, warm-up + cosine schedule and steps) with only the optimizer, its lr and
the seed changed. The plan, in order (``--budget-s`` stops launching runs that would not fit):

1. an lr sweep (seed 0) per optimizer of ``--optimizers`` (``adamw``, ``muon``; ``normuon``,
   Muon with ``optimizer.muon.normalization = "normuon"``, and ``normuon-rms``, the same with
   ``normuon_rescale = "rms"``, when listed),
2. ``--seeds`` more seeds of each at its best lr (lowest final validation loss),
3. the MuonLP variants of ``--lp`` (``int8``, ``int4``, ``fp8`` state) at Muon's best lr and
   each seed, and the Muon variants of ``--variants`` (``turbo``: ``orthogonalization =
   "turbo_muon"``, ``ns_steps = 4``) at Muon's best lr and each of ``--seeds``,
4. Muon (and NorMuon) with shorter schedules (``--budgets``: the same warm-up, the cosine
   decay ending at the budget), each schedule's lr swept like the full one's (seed 0, the
   ``--budget-lrs`` multiples of the optimizer's best full-length lr; default: that lr alone),
   then the other ``--seeds`` at the schedule's best: the steps it needs to reach AdamW's
   best validation loss are those of the shortest schedule that reaches it (linear between
   budgets),
   the usual way to compare optimizers' step efficiency; the step where a full-length Muon run
   crosses that loss is reported beside it, but it is measured mid-schedule, at a high lr;
5. ``--speed-repeats`` rounds of short speed runs (AdamW, then Muon, then each of
   ``--variants``, each alone on the machine, no validation, ``--speed-steps`` steps): their
   tokens/s (median over the logged windows after warm-up, then the median over repeats, with
   the spread) give the speed comparison;
6. with ``--qk-clip TAU`` (or ``auto``): Muon at its best lr, seed 0, logging its largest
   attention logit at every logged step, without clipping and with QK-Clip at TAU
   (``scripts/qk_clip_curves.py``: ``auto`` is half the largest logit of the run without).

Every finished run is kept in ``OUT/curves.json`` (train and validation curves, tokens/s) and
a rerun with the same ``--out`` skips it, so the plan can be split over several invocations.
``--parallel N`` runs up to N ready runs at once on the same machine (one GPU shared): their
curves are as good as any, but their tokens/s is not, so the speed comparison uses only the
runs that had the machine to themselves (``concurrent`` = 1 in the JSON).
From all runs it prints (and writes to ``OUT/summary.md``): per run the final train loss (mean
of the last 5% of steps), the final validation loss and the median tokens/s; per optimizer the
steps it needs to reach AdamW's best validation loss (linear interpolation between evaluations
of the seed-mean curve), and a PNG of the curves (``OUT/convergence.png``, needs matplotlib).
Only ``--write-results`` touches RESULTS.md.

    python scripts/bench_convergence.py --out results/convergence          # the H200 plan
    python scripts/bench_convergence.py --out results/convergence --optimizers adamw,muon,normuon
    python scripts/bench_convergence.py --smoke --out /tmp/conv           # CPU, 2 tiny runs
    python scripts/bench_convergence.py --variants turbo --out results/convergence  # + turbo_muon
    python scripts/bench_convergence.py --report-only --out results/convergence --write-results
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/
import qk_clip_curves  # noqa: E402
from bench_scaling import run_torchrun  # noqa: E402
from bench_titan_tps import machine_text, parse_log  # noqa: E402
from results_md import write_section  # noqa: E402

CONFIG = ROOT / "configs" / "llama3_convergence.toml"
VAL_RE = re.compile(r"validate step:\s*(\d+)\s+loss:\s*([-0-9.naNinf]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")

# The job overrides that make each optimizer; everything else comes from the config.
_NORMUON = ["--optimizer.name", "muon", "--optimizer.muon.normalization", "normuon"]
OPTIMIZER_ARGS = {
    "adamw": ["--optimizer.name", "AdamW"],
    "muon": ["--optimizer.name", "muon"],
    "normuon": _NORMUON,
    # NorMuon with the paper's rescale (an orthogonal update's norm under lr_adjust) instead of
    # the default "frobenius" (Muon's update norm kept): its own lr sweep, the scales differ.
    "normuon-rms": [*_NORMUON, "--optimizer.muon.normuon_rescale", "rms"],
}
SCHEDULED = ("muon", "normuon")
"""The optimizers whose shorter schedules (``--budgets``) are run and swept."""
LP_ARGS = {dtype: ["--optimizer.name", "muon", "--optimizer.muon.state_dtype", dtype]
           for dtype in ("int8", "int4", "fp8")}  # fmt: skip
# Muon variants (``--variants``), run at Muon's best lr and compared with it on the same seeds.
VARIANT_ARGS = {
    "turbo": ["--optimizer.name", "muon", "--optimizer.muon.orthogonalization", "turbo_muon",
              "--optimizer.muon.ns_steps", "4"],
}  # fmt: skip
DEFAULT_LRS = {"adamw": "1e-3,2e-3,4e-3", "muon": "2e-3,4e-3,8e-3", "normuon": "2e-3,4e-3,8e-3",
               "normuon-rms": "2e-3,4e-3,8e-3"}  # fmt: skip
SMOKE_ARGS = [
    "--model.flavor", "bench_tiny", "--training.local_batch_size", "2",
    "--training.seq_len", "128", "--validation.local_batch_size", "2",
    "--validation.seq_len", "128", "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One training run of the plan."""

    optimizer: str  # a key of OPTIMIZER_ARGS, "muonlp-<dtype>" or "muon-<variant>"
    lr: float
    seed: int
    budget: int | None = None  # a shorter schedule (steps); None: the full --steps
    speed: int | None = None  # a speed run (its repeat number): alone, no validation

    @property
    def name(self) -> str:
        if self.speed is not None:
            return f"speed-{self.optimizer}-lr{self.lr:g}-{self.speed}"
        budget = "" if self.budget is None else f"-steps{self.budget}"
        return f"{self.optimizer}-lr{self.lr:g}-seed{self.seed}{budget}"

    def job_args(self) -> list[str]:
        if self.optimizer.startswith("muonlp-"):
            opt = LP_ARGS[self.optimizer.removeprefix("muonlp-")]
        elif qk_clip_curves.is_variant(self.optimizer):
            opt = qk_clip_curves.job_args(self.optimizer)
        elif self.optimizer.startswith("muon-"):
            opt = VARIANT_ARGS[self.optimizer.removeprefix("muon-")]
        else:
            opt = OPTIMIZER_ARGS[self.optimizer]
        return [*opt, "--optimizer.lr", f"{self.lr:g}", "--debug.seed", str(self.seed)]

    def steps(self, args) -> int:
        if self.speed is not None:
            return args.speed_steps
        return args.steps if self.budget is None else self.budget


def parse_curves(text: str) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """(train [[step, loss]], validation [[step, loss]], tps per logged step) of a run's log."""
    text = ANSI_RE.sub("", text)
    steps = parse_log("\n".join(line for line in text.splitlines() if "validate" not in line))
    train = [[s, v["loss"]] for s, v in sorted(steps.items())]
    tps = [v["tps"] for _, v in sorted(steps.items())]
    val = {}
    for line in text.splitlines():
        m = VAL_RE.search(line)
        if m:
            val[int(m.group(1))] = float(m.group(2))
    return train, [[s, v] for s, v in sorted(val.items())], tps


def train_one(run: Run, args, concurrent: int = 1) -> dict:
    """Run ``run`` through train.sh; its record (curves, tokens/s, status)."""
    dump = args.out / "runs" / run.name
    steps = run.steps(args)
    cmd = [
        "bash", str(ROOT / "scripts" / "train.sh"), str(CONFIG), *run.job_args(),
        "--training.steps", str(steps),
        *(["--validation.freq", str(args.val_every)] if run.speed is None
          else ["--validation.no-enable"]),
        "--validation.steps", str(args.val_steps),
        "--metrics.log_freq", str(args.log_every),
        "--job.dump_folder", str(dump),
        *(SMOKE_ARGS if args.smoke else []), *args.extra,
    ]  # fmt: skip
    env = dict(os.environ, SKIP_PREPARE_DATA="1")  # prepare_data() ran once, before any run
    env.setdefault("NPROC", str(args.nproc))
    print(f"[bench_convergence] {run.name}: {' '.join(cmd[2:])}", flush=True)
    start = time.monotonic()
    text, rc = run_torchrun(cmd, args.timeout, cwd=ROOT, env=env)
    wall = time.monotonic() - start
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "train.log").write_text(text)
    train, val, tps = parse_curves(text)
    ok = rc == 0 and train and (val or run.speed is not None) and train[-1][0] == steps
    if not ok:
        print(text[-3000:], file=sys.stderr)
    diverged = next((s for s, loss in train if not math.isfinite(loss)), None)
    if diverged is not None:
        print(f"[bench_convergence] {run.name}: non-finite loss from step {diverged}", flush=True)
    return {
        **asdict(run),
        "name": run.name,
        "status": "ok" if ok else f"failed (rc {rc})",
        "wall_s": round(wall, 1),
        "concurrent": concurrent,  # runs sharing the machine (tokens/s compared only at 1)
        "steps": steps,
        "train": train,
        "val": val,
        "tps": tps,
        "diverged_at": diverged,  # the first logged step with a non-finite loss, or None
        "max_logit": qk_clip_curves.parse(ANSI_RE.sub("", text)),  # runs with QK-Clip only
        "machine": args.machine,
        "date": datetime.date.today().isoformat(),
        "corpus": getattr(args, "corpus", None),  # the training corpus's sha256 (16 digits)
    }


# ---------------------------------------------------------------------------------- analysis


def final_train_loss(record: dict) -> float:
    """Mean train loss over the last 5% of steps (at least the last logged step)."""
    cut = record["steps"] * 0.95
    tail = [loss for step, loss in record["train"] if step > cut] or [record["train"][-1][1]]
    return statistics.fmean(tail)


def solo(record: dict) -> bool:
    """Whether the run had the machine to itself (its tokens/s is comparable)."""
    return record.get("concurrent", 1) == 1


def full_length(record: dict) -> bool:
    """A training run of the full schedule (not a shorter budget, not a speed run)."""
    return record.get("budget") is None and record.get("speed") is None


def median_tps(record: dict) -> float:
    tps = record["tps"][len(record["tps"]) // 10 + 1 :] or record["tps"]  # skip warm-up
    return statistics.median(tps)


def mean_curve(records: list[dict]) -> list[list[float]]:
    """Seed-mean validation curve over the evaluation steps all ``records`` share."""
    common = set.intersection(*({s for s, _ in r["val"]} for r in records))
    return [
        [s, statistics.fmean(dict(map(tuple, r["val"]))[s] for r in records)]
        for s in sorted(common)
    ]


def steps_to_reach(curve: list[list[float]], target: float) -> float | None:
    """First step where ``curve`` (evaluations) reaches ``target``, linearly interpolated."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            (s0, l0) = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def best_lr(records: list[dict], optimizer: str, budget: int | None = None) -> float | None:
    """The lr of ``optimizer`` whose seed-0 run of the full schedule (or of the shorter
    schedule ``budget``) ends with the lowest validation loss (a diverged run is never the
    best)."""
    sweep = [
        r
        for r in records
        if r["optimizer"] == optimizer
        and r["seed"] == 0
        and r["val"]
        and r.get("budget") == budget
        and r.get("speed") is None
        and not r.get("diverged_at")
        and math.isfinite(r["val"][-1][1])
    ]
    return min(sweep, key=lambda r: r["val"][-1][1])["lr"] if sweep else None


def at_muons_lr(optimizer: str) -> bool:
    """Whether ``optimizer`` runs at Muon's best lr (MuonLP and the Muon variants)."""
    return optimizer.startswith(("muonlp-", "muon-"))


def best_groups(full: list[dict]) -> dict[str, list[dict]]:
    """Per optimizer, its full-length runs at its best lr (MuonLP and the Muon variants at
    Muon's), every seed."""
    groups = {}
    for opt in sorted({r["optimizer"] for r in full}):
        lr = best_lr(full, "muon" if at_muons_lr(opt) else opt)
        chosen = [r for r in full if r["optimizer"] == opt and r["lr"] == lr]
        if chosen:
            groups[opt] = chosen
    return groups


def sweep_runs(args, optimizer: str) -> list[Run]:
    lrs = args.lrs[optimizer] if not args.smoke else args.lrs[optimizer][:1]
    return [Run(optimizer, float(lr), 0) for lr in lrs]


def schedule_runs(
    args, records: list[dict], optimizer: str, lr: float, done: set[str]
) -> list[Run]:
    """``optimizer``'s shorter schedules: per budget its lr sweep (seed 0, ``--budget-lrs``
    times its best full-length ``lr``), then the other seeds at the budget's best lr once that
    sweep is done (at once for a sweep of one lr)."""
    runs = []
    for budget in args.budgets:
        sweep = [Run(optimizer, float(f"{lr * m:.6g}"), 0, budget=budget) for m in args.budget_lrs]
        runs += sweep
        best = sweep[0].lr if len(sweep) == 1 else None
        if best is None and {r.name for r in sweep} <= done:
            best = best_lr(records, optimizer, budget)
        if best is not None:
            runs += [Run(optimizer, best, seed, budget=budget) for seed in args.seeds]
    return runs


def plan(args, records: list[dict]) -> list[Run]:
    """The runs still to do and ready to start, in order: the lr sweeps first; an optimizer's
    other seeds once its sweep is done (at once for a sweep of one lr); MuonLP and Muon's
    shorter schedules once Muon's sweep is done; the speed runs once every sweep is done
    (again on another kind of machine than theirs: ``args.machine``)."""
    done = {
        r["name"]
        for r in records
        if r["status"] == "ok" and (r.get("speed") is None or r.get("machine") == args.machine)
    }
    runs = [run for opt in args.optimizers for run in sweep_runs(args, opt)]
    best = {}  # the best lr of every optimizer whose sweep is done or is one lr (no choice)
    for opt in args.optimizers:
        sweep = sweep_runs(args, opt)
        if len(sweep) == 1:
            best[opt] = sweep[0].lr
        elif {r.name for r in sweep} <= done and (lr := best_lr(records, opt)) is not None:
            best[opt] = lr
    for opt, lr in best.items():
        runs += [Run(opt, lr, seed) for seed in args.seeds if seed != 0]
    if "muon" in best:
        muon_lr = best["muon"]
        runs += [Run(f"muonlp-{d}", muon_lr, seed) for d in args.lp for seed in args.lp_seeds]
        runs += [Run(f"muon-{v}", muon_lr, seed) for v in args.variants for seed in args.seeds]
        if args.qk_clip:
            runs.append(Run(qk_clip_curves.MAXLOGIT, muon_lr, 0))
            tau = qk_clip_curves.clip_tau(args.qk_clip, records)
            if tau is not None:
                runs.append(Run(f"{qk_clip_curves.QKCLIP}{tau:g}", muon_lr, 0))
    for opt in (o for o in SCHEDULED if o in best):
        runs += schedule_runs(args, records, opt, best[opt], done)
    if len(best) == len(args.optimizers):
        variants = {f"muon-{v}": best["muon"] for v in args.variants if "muon" in best}
        runs += [
            Run(opt, lr, 0, speed=i)
            for i in range(args.speed_repeats)
            for opt, lr in {**best, **variants}.items()
        ]
    seen: set[str] = set()
    todo = []
    for run in runs:
        if run.name not in done and run.name not in seen:
            seen.add(run.name)
            todo.append(run)
    return todo


def next_batch(todo: list[Run], parallel: int) -> list[Run]:
    """The runs to launch together: up to ``parallel`` training runs, else one speed run (a
    speed run always has the machine to itself)."""
    shared = [r for r in todo if r.speed is None]
    return shared[: max(1, parallel)] if shared else todo[:1]


def solo_tps(records: list[dict], optimizer: str) -> float | None:
    """Mean of the median tokens/s of ``optimizer``'s runs that had the machine to themselves,
    at any lr (the lr does not change the work of a step)."""
    tps = [median_tps(r) for r in records if r["optimizer"] == optimizer and solo(r)]
    return statistics.fmean(tps) if tps else None


def latest_speed_runs(records: list[dict]) -> list[dict]:
    """The speed runs of the machine of the last one: tokens/s are compared only between runs
    of one kind of machine (a plan continued on another reruns them, :func:`plan`)."""
    speed = [r for r in records if r.get("speed") is not None]
    return [r for r in speed if r.get("machine") == speed[-1].get("machine")] if speed else []


def speed_table(records: list[dict]) -> tuple[list[str], dict[str, dict]]:
    """Tokens/s of the speed runs per optimizer (those of one machine and day,
    :func:`latest_speed_runs`): median over repeats and the spread."""
    stats: dict[str, dict] = {}
    speed = latest_speed_runs(records)
    for opt in sorted({r["optimizer"] for r in speed}):
        tps = [median_tps(r) for r in speed if r["optimizer"] == opt]
        stats[opt] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps),
                      "repeats": len(tps)}  # fmt: skip
    if not stats:
        return [], stats
    lines = ["", "| speed runs (alone) | repeats | tokens/s median | min | max | / AdamW's |",
             "|" + " --- |" * 6]  # fmt: skip
    base = stats.get("adamw", {}).get("median")
    for opt, st in stats.items():
        ratio = f"{st['median'] / base:.3f}" if base else "-"
        lines.append(f"| {opt} | {st['repeats']} | {st['median']:,.0f} | {st['min']:,.0f} | "
                     f"{st['max']:,.0f} | {ratio} |")  # fmt: skip
    return lines, stats


def schedule_groups(records: list[dict], optimizer: str) -> dict[int, list[dict]]:
    """Per shorter schedule length of ``optimizer``, its runs at that schedule's best lr
    (:func:`best_lr` of the schedule's seed-0 sweep), every seed."""
    groups = {}
    for budget in sorted({r["budget"] for r in records if r.get("budget")}):
        lr = best_lr(records, optimizer, budget)
        chosen = [r for r in records if r["optimizer"] == optimizer and r.get("budget") == budget
                  and r["lr"] == lr]  # fmt: skip
        if chosen:
            groups[budget] = chosen
    return groups


def schedule_table(
    records: list[dict], runs: list[dict], target: float
) -> tuple[list[str], dict | None]:
    """An optimizer's shorter schedules beside ``runs`` (its full-length best-lr runs), each at
    its own best lr, on the seeds of ``runs``: the mean final validation loss per schedule
    length and the shortest length that reaches ``target`` (linear between lengths; an upper
    bound when the shortest already reaches it)."""
    opt, seeds = runs[0]["optimizer"], {r["seed"] for r in runs}
    by_len = {
        n: kept
        for n, chosen in schedule_groups(records, opt).items()
        if (kept := [r for r in chosen if r["seed"] in seeds])
    }
    if not by_len:
        return [], None
    by_len[runs[0]["steps"]] = runs
    curve = [[n, statistics.fmean(r["val"][-1][1] for r in by_len[n])] for n in sorted(by_len)]
    steps = steps_to_reach(curve, target)
    lines = ["", f"| {opt} schedule length | lr | seeds | final val loss (mean) |",
             "|" + " --- |" * 4]  # fmt: skip
    lines += [f"| {n} | {by_len[n][0]['lr']:g} | {len(by_len[n])} | {v:.4f} |" for n, v in curve]
    lrs = {n: by_len[n][0]["lr"] for n, _ in curve}
    return lines, {"steps": steps, "upper_bound": steps == curve[0][0], "curve": curve, "lrs": lrs}


def place(record: dict) -> tuple[str, str]:
    """(date, machine) of a run."""
    return record.get("date", "?"), record.get("machine", "?")


def run_places(records: list[dict]) -> list[tuple[str, str]]:
    """The distinct (date, machine) of ``records``, oldest first: a plan continued on another
    day or machine lists each, and its tables say which run came from which."""
    return sorted({place(r) for r in records})


def run_tps(optimizer: str, speed: dict[str, dict], full: list[dict]) -> float | None:
    """The tokens/s an optimizer is compared by: its speed runs', else its training runs'
    that had the machine alone; none for the QK-Clip runs (their cost is measured by
    scripts/bench_titan_tps.py and scripts/bench_qk_clip.py)."""
    if qk_clip_curves.is_variant(optimizer):
        return None
    return speed[optimizer]["median"] if optimizer in speed else solo_tps(full, optimizer)


def summarize(records: list[dict]) -> tuple[str, dict]:
    """Markdown tables of ``records`` and the headline numbers."""
    ok = [r for r in records if r["status"] == "ok"]
    places = run_places(records)
    where = (lambda r: f" {places.index(place(r)) + 1} |") if len(places) > 1 else (lambda r: "")
    lines = [
        "| run | final train loss (last 5%) | final val loss | best val loss | tokens/s (median) "
        "| wall s |" + (" run on |" if len(places) > 1 else ""),
        "|" + " --- |" * (6 + (len(places) > 1)),
    ]
    key = lambda r: (r["optimizer"], r["lr"], r.get("budget") or 0, r["seed"])  # noqa: E731
    for r in sorted((r for r in ok if r.get("speed") is None), key=key):
        tps = f"{median_tps(r):,.0f}" + ("" if solo(r) else f" (shared by {r['concurrent']})")
        if r.get("diverged_at"):
            losses = f"diverged (non-finite loss from step {r['diverged_at']}) | - | - |"
        else:
            losses = (f"{final_train_loss(r):.4f} | {r['val'][-1][1]:.4f} | "
                      f"{min(v for _, v in r['val']):.4f} |")  # fmt: skip
        lines.append(f"| {r['name']} | {losses} {tps} | {r['wall_s']:.0f} |" + where(r))
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | - | - | - | - | {r['status']} |" + where(r))
    head: dict = {}
    full = [r for r in ok if full_length(r)]
    groups = best_groups(full)
    adam = groups.get("adamw")
    target = min(v for _, v in mean_curve(adam)) if adam else None
    speed_lines, speed = speed_table(ok)
    lines += [
        "",
        "| optimizer | best lr | seeds | final val loss (mean) | step where the full run "
        "reaches AdamW's best val loss | / AdamW's | tokens/s / AdamW's |",
        "|" + " --- |" * 7,
    ]
    adam_steps = steps_to_reach(mean_curve(adam), target) if adam else None
    adam_tps = run_tps("adamw", speed, full)
    for opt, runs in groups.items():
        curve = mean_curve(runs)
        steps = steps_to_reach(curve, target) if target is not None else None
        tps = run_tps(opt, speed, full)
        ratio = steps / adam_steps if steps is not None and adam_steps else None
        row = {
            "lr": runs[0]["lr"],
            "seeds": len(runs),
            "final_val": curve[-1][1],
            "steps_to_adamw_best": steps,
            "steps_ratio": ratio,
            "tps_ratio": tps / adam_tps if adam_tps and tps else None,
            "tps_from": "speed runs" if opt in speed else "training runs alone",
        }
        head[opt] = row
        cells = [
            "not reached" if steps is None else f"{steps:.0f}",
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if row["tps_ratio"] is None else f"{row['tps_ratio']:.3f}",
        ]
        lines.append(
            f"| {opt} | {row['lr']:g} | {row['seeds']} | {row['final_val']:.4f} | "
            + " | ".join(cells)
            + " |"
        )
    for opt, runs in groups.items():
        seeds = {r["seed"] for r in runs}
        peers = [r for r in groups.get("muon", []) if r["seed"] in seeds]
        if at_muons_lr(opt) and peers:  # against fp32-state Muon on the same seeds
            head[opt]["val_gap_vs_muon"] = head[opt]["final_val"] / mean_curve(peers)[-1][1] - 1
    for opt in (o for o in SCHEDULED if o in groups and target is not None):
        sched_lines, sched = schedule_table(ok, groups[opt], target)  # type: ignore[arg-type]
        lines += sched_lines
        if sched is not None and adam_steps:
            ratio = None if sched["steps"] is None else sched["steps"] / adam_steps
            head[opt]["schedule"] = {**sched, "ratio": ratio}
    lines += speed_lines
    diverged = sorted(r["name"] for r in ok if r.get("diverged_at"))
    if diverged:
        head["diverged"] = diverged
    qk_lines, qk_head = qk_clip_curves.table(ok)
    lines += qk_lines
    if qk_head:
        head["qk_clip"] = qk_head
    return "\n".join(lines), head


COLORS = {"adamw": "tab:blue", "muon": "tab:red", "normuon": "tab:orange",
          "muonlp-int8": "tab:green", "muonlp-int4": "tab:olive",
          "muonlp-fp8": "tab:purple", "muon-turbo": "tab:brown"}  # fmt: skip
# Colors of the other runs' labels (QK-Clip variants, ...), none of the above: taken in order.
OTHER_COLORS = ("tab:pink", "tab:gray", "tab:cyan", "black")


def smooth(values: list[float], width: int = 5) -> list[float]:
    """Trailing moving average (the logged train loss swings with the documents of a step)."""
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def plot(records: list[dict], path: Path) -> bool:
    """The PNG: validation loss of each optimizer at its best lr (seed mean) with Muon's shorter
    schedules and AdamW's best as a line; final validation loss against lr (the sweeps); the
    smoothed train loss at the best lrs. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in records if r["status"] == "ok" and r.get("speed") is None]
    full = [r for r in ok if full_length(r)]
    fig, (ax_v, ax_lr, ax_t) = plt.subplots(1, 3, figsize=(16, 4.6))
    best = best_groups(full)
    others = itertools.cycle(OTHER_COLORS)
    for opt, runs in best.items():
        color = COLORS.get(opt) or next(others)
        steps, losses = zip(*mean_curve(runs), strict=True)
        label = f"{opt} lr {runs[0]['lr']:g} ({len(runs)} seeds)"
        ax_v.plot(steps, losses, marker="o", ms=3, lw=1.2, color=color, label=label)
        train = [dict(map(tuple, r["train"])) for r in runs]
        tsteps = sorted(set.intersection(*(set(t) for t in train)))
        mean = [statistics.fmean(t[s] for t in train) for s in tsteps]
        ax_t.plot(tsteps, smooth(mean), lw=1, color=color, label=opt)
    for opt in SCHEDULED:
        for budget, runs in schedule_groups(ok, opt).items():
            steps, losses = zip(*mean_curve(runs), strict=True)
            ax_v.plot(steps, losses, ls="--", marker=".", lw=1, color=COLORS[opt], alpha=0.6,
                      label=f"{opt}, {budget}-step schedule, lr {runs[0]['lr']:g}")  # fmt: skip
    if "adamw" in best:
        target = min(v for _, v in mean_curve(best["adamw"]))
        ax_v.axhline(target, color=COLORS["adamw"], ls=":", lw=1, label="AdamW's best")
    swept = set()
    for opt in ("adamw", *SCHEDULED):
        sweep = sorted((r["lr"], r["val"][-1][1]) for r in full if r["optimizer"] == opt
                       and r["seed"] == 0)  # fmt: skip
        if sweep:
            ax_lr.plot(*zip(*sweep, strict=True), marker="o", color=COLORS[opt], label=opt)
            swept.update(lr for lr, _ in sweep)
    ax_lr.set_xscale("log")
    lrs = sorted(swept)
    ax_lr.set_xticks(lrs, [f"{lr:g}" for lr in lrs])  # the swept lrs only
    ax_lr.minorticks_off()
    ax_v.set_ylim(top=min(6.0, ax_v.get_ylim()[1]))
    for ax, title, xlabel in ((ax_v, "validation loss", "step"),
                              (ax_lr, "final validation loss (seed 0)", "lr"),
                              (ax_t, "train loss (moving average of 5 logs)", "step")):  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------------- main


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(the script's arguments, the job overrides after "--")``."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, extra = split_extra(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_convergence")
    p.add_argument("--optimizers", default="adamw,muon")
    for name, lrs in DEFAULT_LRS.items():  # --lrs-adamw, --lrs-muon, ...
        p.add_argument(f"--lrs-{name}", default=lrs, help=f"{name}'s lr sweep")
    p.add_argument("--seeds", default="0,1", help="seeds at each optimizer's best lr")
    p.add_argument("--lp", default="int8,int4,fp8", help="MuonLP state dtypes ('' for none)")
    p.add_argument("--lp-seeds", default="0", help="seeds of the MuonLP runs")
    p.add_argument("--variants", default="",
                   help="Muon variants at Muon's best lr and --seeds: 'turbo' (turbo_muon, "
                   "ns_steps 4)")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--budgets",
        default="120,180",
        help="shorter Muon (and NorMuon) schedules (steps), at its best lr and --seeds ('' "
        "for none)",
    )
    p.add_argument(
        "--budget-lrs",
        default="1",
        help="each shorter schedule's lr sweep (seed 0), as multiples of the optimizer's best "
        "full-length lr; the other --seeds run at the best of them",
    )
    p.add_argument(
        "--speed-repeats",
        type=int,
        default=None,
        help="rounds of speed runs (one per optimizer), each alone on the machine (default 2; "
        "0 with --smoke)",
    )
    p.add_argument("--speed-steps", type=int, default=100, help="steps of a speed run")
    p.add_argument("--val-every", type=int, default=30)
    p.add_argument("--val-steps", type=int, default=8)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--nproc", type=int, default=1, help="processes per run (train.sh NPROC)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--parallel", type=int, default=1,
                   help="ready runs launched at once (sharing the machine: their tokens/s is "
                   "left out of the speed comparison)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="launch no run that would end after this many seconds")  # fmt: skip
    p.add_argument("--qk-clip", default="",
                   help="QK-Clip runs at Muon's best lr: a tau, or 'auto' (half the largest "
                   "logit of Muon's run without clipping); '' for none")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="CPU check: tiny model, first lr of each optimizer")  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="no runs: report OUT/curves.json")
    p.add_argument("--write-results", action="store_true", help="update RESULTS.md")
    args = p.parse_args(argv)
    args.extra = extra
    args.out = args.out.resolve()
    args.machine = machine_text(args.nproc)  # this machine: speed runs of another are redone
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    for o in args.optimizers:
        if o not in OPTIMIZER_ARGS:
            p.error(f"--optimizers: unknown optimizer {o!r}; choose from {sorted(OPTIMIZER_ARGS)}")
    args.lrs = {
        name: getattr(args, f"lrs_{name.replace('-', '_')}").split(",") for name in DEFAULT_LRS
    }
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.lp_seeds = [int(s) for s in args.lp_seeds.split(",") if s]
    args.lp = [d for d in args.lp.split(",") if d]
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    try:
        args.budget_lrs = [float(m) for m in args.budget_lrs.split(",") if m]
    except ValueError:
        p.error(f"--budget-lrs: {args.budget_lrs!r} is not a comma-separated list of numbers")
    if not args.budget_lrs or any(not (m > 0 and math.isfinite(m)) for m in args.budget_lrs):
        p.error(f"--budget-lrs: {args.budget_lrs} must be positive multiples of the best lr")
    for d in args.lp:
        if d not in LP_ARGS:
            p.error(f"--lp: unknown state dtype {d!r}; choose from {sorted(LP_ARGS)}")
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        if v not in VARIANT_ARGS:
            p.error(f"--variants: unknown variant {v!r}; choose from {sorted(VARIANT_ARGS)}")
    if args.smoke:
        args.seeds, args.lp, args.budgets = [0], [], []
    if args.speed_repeats is None:
        args.speed_repeats = 0 if args.smoke else 2
    return args


def wall_estimate(records: list[dict], batch: list[Run]) -> float:
    """Expected seconds of ``batch``: the median wall time of finished runs of its kind (speed
    runs or training runs), else of any finished run; 0 before the first."""
    speed = batch[0].speed is not None
    done = [r for r in records if r["status"] == "ok"]
    alike = [r["wall_s"] for r in done if (r.get("speed") is not None) == speed]
    walls = alike or [r["wall_s"] for r in done]
    return statistics.median(walls) if walls else 0.0


def prepare_data() -> None:
    """Build the corpus once (what train.sh does on first use), so that runs launched together
    do not build it at the same time; ``SKIP_PREPARE_DATA=1`` keeps ``DATA_DIR`` as it is."""
    if os.environ.get("SKIP_PREPARE_DATA") == "1":
        return
    python = os.environ.get("PYTHON") or sys.executable
    out = os.environ.get("DATA_DIR", "data")
    cmd = [python, str(ROOT / "scripts" / "prepare_data.py"), "--out", out, "--quiet"]
    subprocess.run(cmd, cwd=ROOT, check=True)


def corpus_hash() -> str | None:
    """The first 16 hex digits of the training corpus's sha256 (``DATA_DIR``'s manifest, as
    scripts/prepare_data.py wrote it), or None without one."""
    manifest = ROOT / os.environ.get("DATA_DIR", "data") / "manifest.json"
    if not manifest.exists():
        return None
    return json.loads(manifest.read_text()).get("corpus_sha256", "")[:16] or None


def check_corpus(records: list[dict], corpus: str | None) -> None:
    """Refuse to add runs on ``corpus`` to a plan whose runs trained on another one (their
    losses would not be comparable); runs from before runs recorded their corpus pass."""
    known = sorted({r["corpus"] for r in records if r.get("corpus")})
    if known and corpus not in known:
        raise SystemExit(
            f"[bench_convergence] the plan's runs trained on corpus {', '.join(known)}, but "
            f"the data here is corpus {corpus}: continue it with the same data/ (built by the "
            "same pinned packages, or copied), or start a new --out"
        )


def run_plan(args, data: dict, store: Path) -> list[dict]:
    """Launch the plan's runs, batch after batch, until done, out of budget or a run fails;
    every finished batch is saved to ``store`` at once."""
    records: list[dict] = data["runs"]
    if plan(args, records):
        prepare_data()
        args.corpus = corpus_hash()
        check_corpus(records, args.corpus)
    start = time.monotonic()
    while todo := plan(args, records):
        batch = next_batch(todo, args.parallel)
        if time.monotonic() - start + wall_estimate(records, batch) > args.budget_s:
            print(f"[bench_convergence] budget reached; {len(todo)} runs left", flush=True)
            break
        n = len(batch)
        with ThreadPoolExecutor(n) as pool:
            finished = list(pool.map(train_one, batch, [args] * n, [n] * n))
        names = {r["name"] for r in finished}
        records = [r for r in records if r["name"] not in names] + finished
        data.update(runs=records, machine=args.machine,
                    date=datetime.date.today().isoformat())  # fmt: skip
        store.write_text(json.dumps(data))
        failed = [r for r in finished if r["status"] != "ok"]
        if failed:
            print(f"[bench_convergence] {failed[0]['name']} {failed[0]['status']}; stopping",
                  flush=True)  # fmt: skip
            break
    return records


def verdicts(head: dict) -> list[str]:
    """The headline comparisons against the benchmark's targets, one line each."""
    out = []
    muon = head.get("muon") or {}
    sched = muon.get("schedule")
    if sched and sched["ratio"] is not None:
        bound = "at most " if sched["upper_bound"] else ""
        out.append(f"Muon's shortest schedule reaching AdamW's best validation loss: "
                   f"{bound}{sched['steps']:.0f} steps, {bound}{sched['ratio']:.2f} of "
                   "AdamW's (target <= 0.6)")  # fmt: skip
    elif sched:
        out.append("no shorter Muon schedule reached AdamW's best validation loss")
    if muon.get("steps_ratio") is not None:
        out.append(f"a full-length Muon run passes AdamW's best validation loss at "
                   f"{muon['steps_ratio']:.2f} of AdamW's steps (mid-schedule)")  # fmt: skip
    if muon.get("tps_ratio") is not None:
        out.append(f"Muon tokens/s = {muon['tps_ratio']:.3f} x AdamW's, from "
                   f"{muon['tps_from']} (target >= 0.97)")  # fmt: skip
    normuon = head.get("normuon") or {}
    sched = normuon.get("schedule")
    if sched and sched["ratio"] is not None:
        bound = "at most " if sched["upper_bound"] else ""
        out.append(f"NorMuon's shortest schedule reaching AdamW's best validation loss: "
                   f"{bound}{sched['steps']:.0f} steps, {bound}{sched['ratio']:.2f} of "
                   "AdamW's (target <= 0.5)")  # fmt: skip
    elif sched:
        out.append("no shorter NorMuon schedule reached AdamW's best validation loss")
    if normuon.get("tps_ratio") is not None:
        vs_muon = ""
        if muon.get("tps_ratio"):
            vs_muon = f", {normuon['tps_ratio'] / muon['tps_ratio']:.3f} x Muon's"
        out.append(f"NorMuon tokens/s = {normuon['tps_ratio']:.3f} x AdamW's{vs_muon}, from "
                   f"{normuon['tps_from']}")  # fmt: skip
    return out + gap_verdicts(head)


def gap_verdicts(head: dict) -> list[str]:
    """The diverged runs, and the final validation loss of MuonLP and the Muon variants
    against fp32-state Muon's."""
    out = []
    diverged = head.get("diverged") or []
    if diverged:
        out.append(f"{len(diverged)} run(s) diverged (non-finite loss): {', '.join(diverged)}")
    for opt, row in head.items():
        if isinstance(row, dict) and "val_gap_vs_muon" in row:
            target = " (target within 1%)" if opt.startswith("muonlp-") else ""
            out.append(f"{opt} final validation loss {100 * row['val_gap_vs_muon']:+.2f}% vs "
                       f"fp32-state Muon{target}")  # fmt: skip
    return out


def report(args, data: dict, records: list[dict]) -> None:
    """Print and write the summary (``OUT/summary.md``, ``summary.json``), the PNG, and with
    ``--write-results`` RESULTS.md's section."""
    table, head = summarize(records)
    places = run_places(records)
    if len(places) > 1:  # numbered as the runs table's last column
        where = "; ".join(f"({i}) {d}, {m}" for i, (d, m) in enumerate(places, 1))
    else:
        where = ", ".join(places[0]) if places else "?"
    corpora = sorted({r["corpus"] for r in records if r.get("corpus")})
    if corpora:
        where += f"; corpus sha256 {', '.join(corpora)}"
    meta = (
        f"{where}; configs/llama3_convergence.toml"
        f"{' (smoke)' if args.smoke else ''}, {args.steps} steps"
        + (f", overrides `{' '.join(args.extra)}`" if args.extra else "")
    )
    png = args.out / "convergence.png"
    plotted = plot(records, png)
    qk_png = args.out / "qk_clip_max_logit.png"
    qk_plotted = qk_clip_curves.plot(records, qk_png)
    text = "\n".join([meta, "", table, "", *(f"- {v}" for v in verdicts(head))])
    (args.out / "summary.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps({"meta": meta, "optimizers": head}, indent=1))
    print(text)
    if not plotted:
        print("[bench_convergence] matplotlib not installed: no PNG", flush=True)
    if args.write_results:
        rel = png.relative_to(ROOT) if png.is_relative_to(ROOT) else png
        body = "\n".join(["## Convergence (scripts/bench_convergence.py)", "", text, ""])
        if plotted:
            body += f"\n![train and validation loss]({rel})\n"
        if qk_plotted:
            qk_rel = qk_png.relative_to(ROOT) if qk_png.is_relative_to(ROOT) else qk_png
            body += f"\n![QK-Clip: largest attention logit per step]({qk_rel})\n"
        write_section(ROOT / "RESULTS.md", "bench_convergence", body)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "curves.json"
    data = json.loads(store.read_text()) if store.exists() else {"runs": []}
    for r in data["runs"]:  # a plan's runs before runs carried their own machine and date
        r.setdefault("machine", data.get("machine", "?"))
        r.setdefault("date", data.get("date", "?"))
    records = data["runs"] if args.report_only else run_plan(args, data, store)
    report(args, data, records)
    return 1 if any(r["status"] != "ok" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
