#!/usr/bin/env python
"""Throughput of a torchtitan run with AdamW and with Muon: tokens/s from torchtitan's log.

Runs ``scripts/train.sh CONFIG`` once per optimizer (``--optimizer.name AdamW`` / ``muon``) for
``--steps`` steps with ``--metrics.log_freq 1``, parses torchtitan's per-step lines
(``step: 5  loss: ...  tps: 12,345  tflops: ...``; tps is tokens per second per device), and
reports the median tps over the steps after ``--skip`` (start-up, warm-up), and Muon / AdamW.
With ``--repeats N`` every optimizer runs N times, interleaved (A, B, A, B, ...), so that a
drift of the machine touches all of them alike; the row is then the median of the runs' medians
and its spread is the runs' lowest and highest median.

    python scripts/bench_titan_tps.py CONFIG [--steps 12] [--skip 3] [--nproc N] [--repeats N]
        [--optimizers AdamW,muon] [--local-data] [--target 0.95] [--log-dir DIR]
        [--results RESULTS.md] [--json out.json] [-- extra torchtitan overrides ...]

An entry ``muon+qk_clip`` of ``--optimizers`` is Muon with QK-Clip on
(``--optimizer.muon.qk_clip_tau`` of ``--qk-clip-tau``, default 100: Kimi K2's), so
``--optimizers muon,muon+qk_clip`` measures what QK-Clip costs a step (the statistic of every
attention call and the clip after the optimizer step); a very large tau measures the statistic
alone.

``--local-data`` points the run at scripts/prepare_data.py's corpus and tokenizer (what
train.sh builds under ``$DATA_DIR``, default data/): no hub access, e.g. for
configs/llama3_8b_muon.toml on a machine without network. ``--nproc`` sets train.sh's NPROC
(default: one per GPU, 2 on CPU); ``$PYTHON`` is passed through to train.sh. With
``--results`` the table goes into RESULTS.md between ``<!-- bench_titan_tps:start -->`` and
``<!-- bench_titan_tps:end -->`` (``bench_titan_tps_qk_clip`` when a ``+qk_clip`` entry ran).
CPU smoke test:

    python scripts/bench_titan_tps.py configs/llama3_debug_muon.toml --nproc 2 --steps 4 --skip 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/
from bench_scaling import run_torchrun  # noqa: E402
from results_md import write_section  # noqa: E402

STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-0-9.naNinf]+).*?tps:\s*([\d,]+)")
MEM_RE = re.compile(r"memory:\s*([0-9.]+)GiB")


def parse_log(text: str) -> dict[int, dict[str, float]]:
    """Per step: loss and tps (tokens/s per device) of torchtitan's metric lines."""
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        m = STEP_RE.search(line)
        if m:
            mem = MEM_RE.search(line)
            out.setdefault(
                int(m.group(1)),
                {
                    "loss": float(m.group(2)),
                    "tps": float(m.group(3).replace(",", "")),
                    "mem_gib": float(mem.group(1)) if mem else float("nan"),
                },
            )
    return out


def summarize(optimizer: str, steps: dict[int, dict[str, float]], skip: int) -> dict:
    kept = [v for s, v in sorted(steps.items()) if s > skip]
    tps = [v["tps"] for v in kept]
    return {
        "optimizer": optimizer,
        "runs": 1,
        "steps_logged": len(steps),
        "steps_used": len(kept),
        "tps_median": statistics.median(tps) if tps else None,
        "tps_min": min(tps) if tps else None,
        "tps_max": max(tps) if tps else None,
        "first_loss": steps[min(steps)]["loss"] if steps else None,
        "last_loss": steps[max(steps)]["loss"] if steps else None,
        "mem_gib": max((v["mem_gib"] for v in kept), default=None),
    }


def combine(runs: list[dict]) -> dict:
    """One optimizer's row over its repeated runs: the median of the runs' median tps, the
    spread between their lowest and highest median, the first run's losses, the highest peak
    memory. A failed run fails the row."""
    if len(runs) == 1:
        return runs[0]
    failed = [r["status"] for r in runs if r["status"] != "ok"]
    medians = [r["tps_median"] for r in runs if r["tps_median"] is not None]
    return {
        **runs[0],
        "runs": len(runs),
        "run_medians": medians,
        "steps_used": sum(r["steps_used"] for r in runs),
        "tps_median": statistics.median(medians) if medians else None,
        "tps_min": min(medians, default=None),
        "tps_max": max(medians, default=None),
        "mem_gib": max((r["mem_gib"] for r in runs if r["mem_gib"] is not None), default=None),
        "status": failed[0] if failed else "ok",
    }


def local_data_args() -> list[str]:
    data = Path(os.environ.get("DATA_DIR", "data"))
    if not data.is_absolute():
        data = ROOT / data
    return [
        "--model.hf_assets_path", str(data / "tokenizer"),
        "--training.dataset", "c4_test",
        "--training.dataset_path", str(data / "corpus"),
    ]  # fmt: skip


QK_CLIP_VARIANT = "+qk_clip"


def optimizer_args(optimizer: str, qk_clip_tau: float) -> list[str]:
    """The job overrides of an ``--optimizers`` entry (``NAME`` or ``NAME+qk_clip``)."""
    name = optimizer.removesuffix(QK_CLIP_VARIANT)
    qk = ["--optimizer.muon.qk_clip_tau", f"{qk_clip_tau:g}"] if name != optimizer else []
    return ["--optimizer.name", name, *qk]


def run_one(optimizer: str, args, extra: list[str], repeat: int = 0) -> tuple[str, int]:
    """train.sh with ``optimizer``; (log text, return code). The log also goes to --log-dir
    (``OPTIMIZER.log``, ``OPTIMIZER.REPEAT.log`` for the later repeats)."""
    tag = f"{optimizer}.{repeat}" if repeat else optimizer
    cmd = [
        "bash", str(ROOT / "scripts" / "train.sh"), str(args.config),
        *optimizer_args(optimizer, args.qk_clip_tau),
        "--training.steps", str(args.steps),
        "--metrics.log_freq", "1",
        "--metrics.disable_color_printing",
        "--job.dump_folder", str(args.log_dir / f"dump_{tag}"),
        *(local_data_args() if args.local_data else []),
        *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    if args.nproc:
        env["NPROC"] = str(args.nproc)
    print(f"[bench_titan_tps] {optimizer}: {' '.join(cmd)}", flush=True)
    # train.sh execs torchrun: on timeout it gets SIGTERM and stops its workers.
    text, rc = run_torchrun(cmd, args.timeout, cwd=ROOT, env=env)
    (args.log_dir / f"{tag}.log").write_text(text)
    return text, rc


def table(rows: list[dict], target: float) -> tuple[str, str]:
    spread = "runs' medians min-max" if any(r.get("runs", 1) > 1 for r in rows) else "min-max"
    lines = [
        f"| optimizer | tps / device (median) | {spread} | runs | steps used | "
        "loss first -> last | peak mem GiB | status |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        runs = r.get("runs", 1)
        if r["tps_median"] is None:
            lines.append(f"| {r['optimizer']} | - | - | {runs} | 0 | - | - | {r['status']} |")
            continue
        lines.append(
            f"| {r['optimizer']} | {r['tps_median']:,.0f} | {r['tps_min']:,.0f}-"
            f"{r['tps_max']:,.0f} | {runs} | {r['steps_used']} | {r['first_loss']:.3f} -> "
            f"{r['last_loss']:.3f} | {r['mem_gib']:.1f} | {r['status']} |"
        )
    by_name = {r["optimizer"].lower(): r for r in rows}
    adam, muon = by_name.get("adamw"), by_name.get("muon")
    clip = by_name.get("muon" + QK_CLIP_VARIANT)
    verdict = ""
    if muon and clip and muon["tps_median"] and clip["tps_median"]:
        ratio = clip["tps_median"] / muon["tps_median"]
        verdict += f"Muon with QK-Clip / Muon tokens/s = {ratio:.3f}. "
    if adam and muon and adam["tps_median"] and muon["tps_median"]:
        ratio = muon["tps_median"] / adam["tps_median"]
        ok = "meets" if ratio >= target else "misses"
        verdict += (
            f"Muon / AdamW tokens/s = {ratio:.3f} ({100 * abs(1 - ratio):.1f}% "
            f"{'slower' if ratio < 1 else 'faster'}); "
            f"{ok} the target of >= {target:.2f}."
        )
    return "\n".join(lines), verdict


def machine_text(nproc: int | None) -> str:
    try:
        import torch

        if torch.cuda.is_available():
            n = nproc or torch.cuda.device_count()
            return f"{n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        return (
            f"CPU ({os.cpu_count()} cores, gloo, {nproc or 2} processes), torch {torch.__version__}"
        )
    except Exception:
        return "unknown machine"


def results_section(meta: str, text: str, verdict: str, qk_clip_tau: float | None) -> str:
    """The RESULTS.md section of a run: AdamW vs Muon, or (``qk_clip_tau``) Muon with and
    without QK-Clip, which names the tau its QK-Clip runs add instead of the AdamW target."""
    title = "AdamW vs Muon" if qk_clip_tau is None else "Muon with and without QK-Clip"
    what = (
        "the target is Muon within 5% of AdamW on 8 GPUs."
        if qk_clip_tau is None
        else f"the QK-Clip runs add `--optimizer.muon.qk_clip_tau {qk_clip_tau:g}`."
    )
    return "\n".join(
        [
            f"## torchtitan throughput, {title} (scripts/bench_titan_tps.py)",
            "",
            meta + ".",
            "",
            "tps is torchtitan's tokens per second per device (`--metrics.log_freq 1`); "
            + what
            + " Logs: `--log-dir`.",
            "",
            text,
            "",
            verdict,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--optimizers", default="AdamW,muon")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the median")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each optimizer, interleaved"
    )
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument(
        "--qk-clip-tau", type=float, default=100.0, help="tau of the muon+qk_clip entry"
    )
    parser.add_argument("--local-data", action="store_true")
    parser.add_argument("--target", type=float, default=0.95, help="wanted Muon / AdamW tps")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "outputs" / "bench_titan_tps")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.config = args.config.resolve()
    args.log_dir = args.log_dir.resolve()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    runs: dict[str, list[dict]] = {o: [] for o in optimizers}
    for repeat in range(args.repeats):
        for optimizer in optimizers:
            text, rc = run_one(optimizer, args, extra, repeat)
            row = summarize(optimizer, parse_log(text), args.skip)
            ok = rc == 0 and row["tps_median"] is not None
            row["status"] = "ok" if ok else f"failed (rc {rc})"
            if not ok:
                print(text[-4000:], file=sys.stderr)
            runs[optimizer].append(row)
    rows = [combine(runs[o]) for o in optimizers]
    text, verdict = table(rows, args.target)
    meta = (
        f"{datetime.date.today().isoformat()}, {machine_text(args.nproc)}; "
        f"{args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}"
        f", {args.steps} steps, median tps after step {args.skip}"
        + (f", {args.repeats} runs each, interleaved" if args.repeats > 1 else "")
        + (", local corpus and tokenizer (scripts/prepare_data.py)" if args.local_data else "")
        + (f", overrides: `{' '.join(extra)}`" if extra else "")
    )
    print(meta)
    print(text)
    if verdict:
        print(verdict)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "verdict": verdict}, indent=1))
    if args.results:
        qk = any(r["optimizer"].endswith(QK_CLIP_VARIANT) for r in rows)
        section = results_section(meta, text, verdict, args.qk_clip_tau if qk else None)
        # the QK-Clip comparison has its own section: the AdamW vs Muon one stays
        write_section(args.results, "bench_titan_tps_qk_clip" if qk else "bench_titan_tps", section)
        print(f"wrote {args.results}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
