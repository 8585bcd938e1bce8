"""CPU smoke test of scripts/bench_convergence.py: two tiny torchtitan runs, outputs checked.

Checks what the script writes (the curves JSON, the summary tables, the PNG when matplotlib is
installed) and the analysis on hand-made curves; the losses of the tiny runs are not judged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_convergence as bc  # noqa: E402

pytestmark = pytest.mark.slow


def _step_line(s: int) -> str:
    """A torchtitan training-step log line (step ``s``), as a faked run prints it."""
    return (
        f"step: {s}  loss:  {9 - s:.4f}  grad_norm: 1.0  memory: 1.0GiB(1%)  tps: 1,000  "
        "tflops: 1.0  mfu: 1.0%"
    )


def _job(args: list[str]):
    """The torchtitan job (parsed, not run) of a run's train.sh command line or of its job
    arguments (``Run.job_args()``)."""
    from muon_plugin.torchtitan.check import check

    config = str(bc.CONFIG)
    return check(config, args[args.index(config) + 1 :] if config in args else args)


def test_steps_to_reach_interpolates_between_evaluations():
    curve = [[10, 5.0], [20, 4.0], [30, 3.0]]
    assert bc.steps_to_reach(curve, 5.0) == 10.0
    assert bc.steps_to_reach(curve, 3.5) == pytest.approx(25.0)
    assert bc.steps_to_reach(curve, 2.9) is None


def _record(opt, lr, seed, val, tps=100.0, steps=20):
    return {
        "optimizer": opt, "lr": lr, "seed": seed, "name": bc.Run(opt, lr, seed).name,
        "status": "ok", "wall_s": 1.0, "steps": steps,
        "train": [[s, 9.0 - s / 10] for s in range(1, steps + 1)],
        "val": val, "tps": [tps] * steps,
    }  # fmt: skip


def test_summary_picks_best_lr_and_compares_with_adamw():
    records = [
        _record("adamw", 1e-3, 0, [[10, 5.0], [20, 4.0]]),
        _record("adamw", 2e-3, 0, [[10, 4.8], [20, 3.8]]),  # AdamW's best: 3.8 at step 20
        _record("muon", 4e-3, 0, [[10, 3.8], [20, 3.0]], tps=97.0),  # reaches 3.8 at step 10
        _record("muon", 8e-3, 0, [[10, 4.5], [20, 3.5]], tps=97.0),
        _record("muonlp-int8", 4e-3, 0, [[10, 3.9], [20, 3.03]]),
        {**_record("muon", 4e-3, 1, [[10, 3.8], [20, 3.0]], tps=50.0), "concurrent": 2},
    ]
    table, head = bc.summarize(records)
    assert "(shared by 2)" in table  # a run that shared the machine: its tokens/s not compared
    assert head["adamw"]["lr"] == 2e-3 and head["muon"]["lr"] == 4e-3
    assert head["muon"]["steps_ratio"] == pytest.approx(0.5) and head["muon"]["seeds"] == 2
    assert head["muon"]["tps_ratio"] == pytest.approx(0.97)
    assert head["muonlp-int8"]["val_gap_vs_muon"] == pytest.approx(0.01)


def test_shorter_schedules_and_speed_runs():
    """Muon's steps to AdamW's best: the shortest schedule reaching it (linear between
    schedule lengths); tokens/s from the speed runs (median over repeats)."""
    records = [
        _record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]),
        _record("muon", 4e-3, 0, [[10, 3.9], [20, 3.0]]),
        {**_record("muon", 4e-3, 0, [[10, 3.9]], steps=10), "budget": 10},
        {**_record("muon", 4e-3, 0, [[10, 4.2], [15, 3.7]], steps=15), "budget": 15},
        {**_record("adamw", 1e-3, 0, [], tps=100.0), "speed": 0},
        {**_record("adamw", 1e-3, 0, [], tps=102.0), "speed": 1},
        {**_record("muon", 4e-3, 0, [], tps=98.0), "speed": 0},
        {**_record("muon", 4e-3, 0, [], tps=97.0), "speed": 1},
    ]
    table, head = bc.summarize(records)
    sched = head["muon"]["schedule"]
    assert sched["curve"] == [[10, 3.9], [15, 3.7], [20, 3.0]]
    assert sched["steps"] == pytest.approx(12.5) and sched["ratio"] == pytest.approx(0.625)
    assert not sched["upper_bound"]
    assert head["muon"]["tps_ratio"] == pytest.approx(97.5 / 101)
    assert head["muon"]["tps_from"] == "speed runs"
    assert head["muon"]["seeds"] == 1  # budget and speed runs are not full-length seeds
    assert "| speed runs (alone) |" in table and "| 15 | 0.004 | 1 | 3.7000 |" in table


def test_each_shorter_schedule_gets_its_own_lr_sweep():
    """``--budget-lrs``: a shorter schedule is swept (seed 0) at those multiples of the
    optimizer's best full-length lr, its other seeds run at the schedule's best, and the
    report compares each schedule at its own best lr."""
    args = bc.parse_args(
        ["--optimizers", "adamw,muon", "--lp", "", "--seeds", "0,1", "--budgets", "10,15",
         "--budget-lrs", "1,1.5", "--speed-repeats", "0", "--lrs-adamw", "1e-3",
         "--lrs-muon", "4e-3"]
    )  # fmt: skip
    full = [
        _record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]),
        _record("adamw", 1e-3, 1, [[10, 4.5], [20, 3.8]]),
        _record("muon", 4e-3, 0, [[10, 3.9], [20, 3.0]]),
        _record("muon", 4e-3, 1, [[10, 3.9], [20, 3.0]]),
    ]
    assert [r.name for r in bc.plan(args, full)] == [
        "muon-lr0.004-seed0-steps10", "muon-lr0.006-seed0-steps10",
        "muon-lr0.004-seed0-steps15", "muon-lr0.006-seed0-steps15",
    ]  # fmt: skip

    def short(lr, seed, budget, loss):
        name = bc.Run("muon", lr, seed, budget=budget).name
        record = _record("muon", lr, seed, [[budget, loss]], steps=budget)
        return {**record, "budget": budget, "name": name}

    swept = [*full, short(4e-3, 0, 10, 4.0), short(6e-3, 0, 10, 3.85),
             short(4e-3, 0, 15, 3.6), short(6e-3, 0, 15, 3.7)]  # fmt: skip
    # Each schedule's sweep done: seed 1 at that schedule's best lr, 0.006 and 0.004.
    assert [r.name for r in bc.plan(args, swept)] == [
        "muon-lr0.006-seed1-steps10", "muon-lr0.004-seed1-steps15"
    ]  # fmt: skip
    records = [*swept, short(6e-3, 1, 10, 3.75), short(4e-3, 1, 15, 3.7)]
    table, head = bc.summarize(records)
    sched = head["muon"]["schedule"]
    assert sched["lrs"] == {10: 6e-3, 15: 4e-3, 20: 4e-3}
    assert sched["curve"] == [[10, pytest.approx(3.8)], [15, pytest.approx(3.65)], [20, 3.0]]
    assert sched["steps"] == pytest.approx(10.0) and sched["upper_bound"]
    assert "| 10 | 0.006 | 2 | 3.8000 |" in table and "| 15 | 0.004 | 2 | 3.6500 |" in table
    with pytest.raises(SystemExit):
        bc.parse_args(["--budget-lrs", "1,-2"])
    with pytest.raises(SystemExit):
        bc.parse_args(["--budget-lrs", "x"])


def test_normuon_gets_its_sweep_schedules_speed_runs_and_verdicts():
    """With ``--optimizers adamw,muon,normuon``: NorMuon is swept, then run with the shorter
    schedules at its own best lr like Muon; the summary gives both schedule ratios."""
    args = bc.parse_args(
        ["--optimizers", "adamw,muon,normuon", "--lp", "", "--seeds", "0", "--budgets", "10",
         "--speed-repeats", "1", "--lrs-normuon", "4e-3,8e-3"]
    )  # fmt: skip
    first = bc.plan(args, [])
    assert [r.optimizer for r in first] == ["adamw"] * 3 + ["muon"] * 3 + ["normuon"] * 2
    done = [_record(r.optimizer, r.lr, r.seed, [[10, 4.0 + r.lr]]) for r in first]
    names = [r.name for r in bc.plan(args, done)]
    assert names == [
        "muon-lr0.002-seed0-steps10", "normuon-lr0.004-seed0-steps10",
        "speed-adamw-lr0.001-0", "speed-muon-lr0.002-0", "speed-normuon-lr0.004-0",
    ]  # fmt: skip
    records = [
        _record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]),
        _record("muon", 4e-3, 0, [[10, 3.9], [20, 3.0]]),
        _record("normuon", 4e-3, 0, [[10, 3.7], [20, 2.9]]),
        {**_record("muon", 4e-3, 0, [[10, 3.9]], steps=10), "budget": 10},
        {**_record("normuon", 4e-3, 0, [[10, 3.6]], steps=10), "budget": 10},
        {**_record("adamw", 1e-3, 0, [], tps=100.0), "speed": 0},
        {**_record("muon", 4e-3, 0, [], tps=98.0), "speed": 0},
        {**_record("normuon", 4e-3, 0, [], tps=96.04), "speed": 0},
    ]
    table, head = bc.summarize(records)
    assert head["muon"]["schedule"]["upper_bound"] is False
    assert head["normuon"]["schedule"]["steps"] == 10.0
    assert (
        head["normuon"]["schedule"]["upper_bound"] and head["normuon"]["schedule"]["ratio"] == 0.5
    )
    assert "| normuon schedule length | lr | seeds | final val loss (mean) |" in table
    lines = bc.verdicts(head)
    assert any("NorMuon's shortest schedule" in v and "at most 0.50" in v for v in lines), lines
    assert any("NorMuon tokens/s = 0.960 x AdamW's, 0.980 x Muon's" in v for v in lines), lines


def test_normuon_with_the_papers_rescale_is_swept_as_its_own_optimizer(tmp_path):
    """``normuon-rms`` (``normuon_rescale = "rms"``): its own lr sweep and seeds, a valid job
    whose NorMuon settings the plugin reads, and a row of its own beside NorMuon's."""
    args = bc.parse_args(
        ["--optimizers", "adamw,normuon,normuon-rms", "--lp", "", "--budgets", "",
         "--speed-repeats", "0", "--lrs-normuon-rms", "1e-3,3e-3", "--out", str(tmp_path)]
    )  # fmt: skip
    first = bc.plan(args, [])
    assert [r.name for r in first if r.optimizer == "normuon-rms"] == [
        "normuon-rms-lr0.001-seed0", "normuon-rms-lr0.003-seed0"
    ]  # fmt: skip
    job = _job(first[-1].job_args())
    assert job.optimizer.muon.normalization == "normuon"
    assert job.optimizer.muon.normuon_rescale == "rms" and job.optimizer.lr == 3e-3
    records = [
        _record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]),
        _record("normuon", 4e-3, 0, [[10, 3.7], [20, 2.9]]),
        _record("normuon-rms", 3e-3, 0, [[10, 3.8], [20, 3.1]]),
    ]
    table, head = bc.summarize(records)
    assert head["normuon-rms"]["final_val"] == 3.1 and head["normuon"]["final_val"] == 2.9
    assert "| normuon-rms | 0.003 | 1 | 3.1000 |" in table


def test_a_plan_continued_on_another_machine_redoes_its_speed_runs_only():
    """Training runs of an earlier day and machine are kept (the tables say where each ran);
    tokens/s are compared between speed runs of one machine, so those are run again."""
    args = bc.parse_args(["--optimizers", "adamw,muon", "--lrs-adamw", "1e-3", "--lrs-muon",
                          "4e-3", "--seeds", "0", "--lp", "", "--budgets", "",
                          "--speed-repeats", "1"])  # fmt: skip
    before = {"date": "2026-01-01", "machine": "1 x GPU A"}
    here = {"date": "2026-01-02", "machine": args.machine}

    def speed(opt, lr, tps, where):
        return {**_record(opt, lr, 0, [], tps=tps), "speed": 0,
                "name": bc.Run(opt, lr, 0, speed=0).name, **where}  # fmt: skip

    records = [
        {**_record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]), **before},
        {**_record("muon", 4e-3, 0, [[10, 3.9], [20, 3.0]]), **before},
        speed("adamw", 1e-3, 50.0, before),
        speed("muon", 4e-3, 10.0, before),
    ]
    assert [r.name for r in bc.plan(args, records)] == [
        "speed-adamw-lr0.001-0", "speed-muon-lr0.004-0"
    ]  # fmt: skip
    records[3] = speed("muon", 4e-3, 98.0, here)
    assert [r.name for r in bc.plan(args, records)] == ["speed-adamw-lr0.001-0"]
    records[2] = speed("adamw", 1e-3, 100.0, here)
    assert bc.plan(args, records) == []
    table, head = bc.summarize(records)
    assert head["muon"]["tps_ratio"] == pytest.approx(0.98)
    assert "| run on |" in table and "| muon-lr0.004-seed0 |" in table
    assert table.splitlines()[2].endswith("| 1 |")  # the first training run: the first place
    assert bc.run_places(records) == [tuple(before.values()), tuple(here.values())]


def test_a_plan_continues_only_on_the_corpus_its_runs_trained_on(tmp_path, monkeypatch):
    old = {**_record("muon", 4e-3, 0, [[10, 3.9]]), "corpus": "e91facd5ad2232ea"}
    legacy = _record("adamw", 1e-3, 0, [[10, 4.5]])  # from before runs recorded their corpus
    bc.check_corpus([old, legacy], "e91facd5ad2232ea")
    bc.check_corpus([legacy], "bf75395e6cacaa04")
    with pytest.raises(SystemExit, match="corpus e91facd5ad2232ea, but the data here is corpus "
                                          "bf75395e6cacaa04"):  # fmt: skip
        bc.check_corpus([old, legacy], "bf75395e6cacaa04")
    (tmp_path / "manifest.json").write_text(json.dumps({"corpus_sha256": "ab" * 32}))
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    assert bc.corpus_hash() == "ab" * 8
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "none"))
    assert bc.corpus_hash() is None


def test_a_diverged_run_is_reported_and_never_the_best_lr():
    nan = float("nan")
    diverged = _record("muon", 8e-3, 0, [[10, 3.0], [20, nan]])
    diverged["train"][12:] = [[s, nan] for s, _ in diverged["train"][12:]]
    diverged["diverged_at"] = 13
    records = [
        _record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]),
        _record("muon", 4e-3, 0, [[10, 3.9], [20, 3.4]]),
        diverged,
    ]
    assert bc.best_lr(records, "muon") == 4e-3
    table, head = bc.summarize(records)
    assert "| muon-lr0.008-seed0 | diverged (non-finite loss from step 13) |" in table
    assert head["muon"]["lr"] == 4e-3 and head["diverged"] == ["muon-lr0.008-seed0"]
    assert "1 run(s) diverged (non-finite loss): muon-lr0.008-seed0" in bc.verdicts(head)


def test_qk_clip_runs_follow_muons_sweep_and_auto_tau_halves_the_largest_logit():
    import qk_clip_curves as qk

    log = "\n".join(
        [
            "QK-Clip: max logit 3.5 (layers.1.attention), 0 heads clipped at tau 1e+30",
            "step:  5  loss:  7.1  grad_norm: 1.0  memory: 1.0GiB(1%)  tps: 10  tflops: 1",
            "validate step:  5  loss:  7.3",
            "QK-Clip: max logit 4.25 (layers.0.attention), 2 heads clipped at tau 1e+30: x h1 4",
            "step: 10  loss:  6.9  grad_norm: 1.0  memory: 1.0GiB(1%)  tps: 10  tflops: 1",
        ]
    )
    assert qk.parse(log) == [[5, 3.5, 0], [10, 4.25, 2]]
    assert qk.job_args("muon-qkclip2.5")[-2:] == ["--optimizer.muon.qk_clip_tau", "2.5"]
    assert qk.job_args(qk.MAXLOGIT)[-1] == "1e+30"
    only_muon = ["--optimizers", "muon", "--lrs-muon", "4e-3", "--seeds", "0", "--lp", ""]
    args = bc.parse_args([*only_muon, "--budgets", "", "--speed-repeats", "0", "--qk-clip", "auto"])
    sweep = _record("muon", 4e-3, 0, [[10, 4.0]])
    assert [r.name for r in bc.plan(args, [sweep])] == ["muon-maxlogit-lr0.004-seed0"]
    without = {**_record(qk.MAXLOGIT, 4e-3, 0, [[10, 4.1]]), "max_logit": qk.parse(log)}
    assert qk.clip_tau("auto", [without]) == 2.12  # half of 4.25, three digits
    assert [r.name for r in bc.plan(args, [sweep, without])] == ["muon-qkclip2.12-lr0.004-seed0"]


def test_plan_runs_sweep_then_seeds_then_lp():
    args = bc.parse_args(
        ["--lp", "int8", "--seeds", "0,1", "--lp-seeds", "0,1", "--budgets", "150",
         "--speed-repeats", "1"]
    )  # fmt: skip
    first = bc.plan(args, [])
    assert [r.optimizer for r in first] == ["adamw"] * 3 + ["muon"] * 3
    done = [_record(r.optimizer, r.lr, r.seed, [[10, 4.0 + r.lr]]) for r in first]
    # A sweep still running: no other seeds or MuonLP of that optimizer are ready yet.
    partial = bc.plan(args, done[:4])
    assert [r.name for r in partial] == [
        "muon-lr0.004-seed0", "muon-lr0.008-seed0", "adamw-lr0.001-seed1"
    ]  # fmt: skip
    names = [r.name for r in bc.plan(args, done)]
    assert names == [
        "adamw-lr0.001-seed1", "muon-lr0.002-seed1",
        "muonlp-int8-lr0.002-seed0", "muonlp-int8-lr0.002-seed1",
        "muon-lr0.002-seed0-steps150", "muon-lr0.002-seed1-steps150",
        "speed-adamw-lr0.001-0", "speed-muon-lr0.002-0",
    ]  # fmt: skip
    # Training runs share the machine; a speed run has it to itself, after them.
    todo = bc.plan(args, done)
    assert [r.name for r in bc.next_batch(todo, 3)] == names[:3]
    assert [r.name for r in bc.next_batch(todo[6:], 3)] == ["speed-adamw-lr0.001-0"]


def test_smoke_run_writes_its_outputs(tmp_path):
    out = tmp_path / "conv"
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable, str(ROOT / "scripts" / "bench_convergence.py"), "--smoke",
        "--steps", "3", "--val-every", "3", "--val-steps", "1", "--log-every", "1",
        "--out", str(out), "--parallel", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "curves.json").read_text())
    runs = {r["name"]: r for r in data["runs"]}
    assert sorted(runs) == ["adamw-lr0.001-seed0", "muon-lr0.002-seed0"]
    for name, run in runs.items():  # both at once: each sweep is one lr, so nothing waits
        assert run["status"] == "ok" and run["concurrent"] == 2, name
        assert [s for s, _ in run["train"]] == [1, 2, 3]
        assert run["val"] and run["val"][-1][0] == 3 and run["tps"]
        assert run["max_logit"] == []  # no QK-Clip here (its runs: the next test)
    # (the --variants runs are planned and their command lines checked without training:
    # test_the_turbo_variant_runs_at_muons_best_lr)
    summary = json.loads((out / "summary.json").read_text())
    assert {"adamw", "muon"} <= set(summary["optimizers"])
    summary_md = (out / "summary.md").read_text()
    assert "reaches AdamW's best val loss" in summary_md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_qk_clip_run_is_a_valid_job_and_records_its_largest_logits(tmp_path, monkeypatch):
    """The QK-Clip runs' command lines parse as torchtitan jobs with the tau they are named by
    (the one that only logs: a tau no logit reaches), and their records keep the largest logit
    of every step from the log (the log's format is the real one: tests/torchtitan/
    test_torchtitan_e2e.py reads a QK-Clip run's log with the same parser), then the summary
    and its plot list them."""
    import qk_clip_curves as qk

    seen = []

    def fake_torchrun(cmd, timeout, **kwargs):
        seen.append(cmd)
        clipped = 0 if "1e+30" in cmd else 2
        log = "\n".join(
            f"QK-Clip: max logit {0.1 * s:.2f} (layers.0.attention), {clipped} heads clipped at "
            f"tau 0.05\n{_step_line(s)}\nvalidate step: {s}  loss:  {9.5 - s:.4f}"
            for s in (1, 2, 3)
        )
        return log, 0

    monkeypatch.setattr(bc, "run_torchrun", fake_torchrun)
    args = bc.parse_args(["--out", str(tmp_path), "--steps", "3", "--val-every", "3"])
    records = [bc.train_one(bc.Run(name, 4e-3, 0), args)
               for name in (qk.MAXLOGIT, f"{qk.QKCLIP}0.05")]  # fmt: skip
    for cmd, tau in zip(seen, (1e30, 0.05), strict=True):
        job = _job(cmd)
        assert job.optimizer.name == "muon" and job.optimizer.muon.qk_clip_tau == tau
    for record, clipped in zip(records, (0, 2), strict=True):
        assert record["status"] == "ok", record
        assert record["max_logit"] == [[s, round(0.1 * s, 2), clipped] for s in (1, 2, 3)]
    base = [_record("muon", 4e-3, 0, [[3, 6.5]]), _record("adamw", 1e-3, 0, [[3, 6.6]])]
    table, head = bc.summarize(base + records)
    assert set(head["qk_clip"]) == {"muon-maxlogit", "muon-qkclip0.05"}
    assert "| QK-Clip run | tau |" in table
    # their tokens/s (the statistic's cost inside) is not set against AdamW's: bench_titan_tps's
    assert head["muon-maxlogit"]["tps_ratio"] is None and head["muon"]["tps_ratio"] is not None
    assert "| muon-qkclip0.05 | 0.004 | 1 | 6.5000 | 3 | 0.97 | - |" in table, table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = tmp_path / "qk.png"
    assert qk.plot(base + records, png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_speed_run_is_a_valid_job_without_validation(tmp_path, monkeypatch):
    """A speed run's command line (what train.sh is given) parses as torchtitan's job with
    validation off and the run's steps; its log becomes a record without validation."""
    seen = {}

    def fake_torchrun(cmd, timeout, **kwargs):
        seen["cmd"] = cmd
        log = "\n".join(_step_line(s) for s in (1, 2))
        return log, 0

    monkeypatch.setattr(bc, "run_torchrun", fake_torchrun)
    args = bc.parse_args(["--out", str(tmp_path), "--speed-steps", "2"])
    record = bc.train_one(bc.Run("muon", 4e-3, 0, speed=0), args)
    assert record["status"] == "ok" and record["val"] == [] and record["speed"] == 0
    job = _job(seen["cmd"])
    assert job.validation.enable is False and job.training.steps == 2
    assert job.optimizer.name == "muon" and job.optimizer.lr == 4e-3
    assert job.optimizer.muon.normalization == "none"
    bc.train_one(bc.Run("normuon", 4e-3, 0, speed=0), args)
    job = _job(seen["cmd"])
    assert job.optimizer.name == "muon" and job.optimizer.muon.normalization == "normuon"


def test_the_turbo_variant_runs_at_muons_best_lr(tmp_path):
    """``--variants turbo``: turbo_muon x4 at Muon's best lr on every seed, in the speed runs,
    compared with Muon; its command line parses as torchtitan's job with that option."""
    args = bc.parse_args(
        ["--variants", "turbo", "--lp", "", "--budgets", "", "--seeds", "0,1",
         "--speed-repeats", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    done = [_record(r.optimizer, r.lr, r.seed, [[10, 4.0 + r.lr]]) for r in bc.plan(args, [])]
    names = [r.name for r in bc.plan(args, done)]
    assert names == [
        "adamw-lr0.001-seed1", "muon-lr0.002-seed1", "muon-turbo-lr0.002-seed0",
        "muon-turbo-lr0.002-seed1", "speed-adamw-lr0.001-0", "speed-muon-lr0.002-0",
        "speed-muon-turbo-lr0.002-0",
    ]  # fmt: skip
    job = _job(bc.Run("muon-turbo", 2e-3, 0).job_args())
    assert (job.optimizer.muon.orthogonalization, job.optimizer.muon.ns_steps) == ("turbo_muon", 4)
    records = [
        _record("adamw", 1e-3, 0, [[10, 4.5], [20, 3.8]]),
        _record("muon", 4e-3, 0, [[10, 3.8], [20, 3.0]]),
        _record("muon", 8e-3, 0, [[10, 4.5], [20, 3.5]]),
        _record("muon-turbo", 4e-3, 0, [[10, 3.9], [20, 3.06]]),
    ]
    _, head = bc.summarize(records)
    assert head["muon-turbo"]["lr"] == 4e-3
    assert head["muon-turbo"]["val_gap_vs_muon"] == pytest.approx(0.02)
    with pytest.raises(SystemExit):
        bc.parse_args(["--variants", "turbo_muon"])
