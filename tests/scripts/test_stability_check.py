"""scripts/stability_check.py without training: its command lines are valid torchtitan jobs (the
config check train.sh runs first, which also refuses a bad backend), one per backend, each in a
folder of its own; the verdict of a run from its log (trained, diverged from a step, failed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import stability_check as sc  # noqa: E402

from muon_plugin.torchtitan.check import check  # noqa: E402


def step_line(step: int, loss: str) -> str:
    return (f"[rank0]:[titan] 2026-12-06 13:08:00,418 - root - INFO - step: {step:2d}  loss: "
            f"{loss:>8}  grad_norm:  0.9509  memory: 16.22GiB(20.49%)  tps: 156,920  "
            "tflops: 99.24  mfu: 10.03%")  # fmt: skip


def test_each_backend_is_a_valid_job_of_its_own(tmp_path, capsys):
    args = sc.parse_args(["--out", str(tmp_path), "--", "--training.local_batch_size", "2"])
    assert args.backends == sc.BACKENDS.split(",") and args.lr == 4e-3 and args.steps == 150
    commands = [sc.command(b, args) for b in args.backends]
    dumps = set()
    for backend, cmd in zip(args.backends, commands, strict=True):
        job = check(cmd[2], cmd[3:])
        assert job.optimizer.muon.backend == backend and job.training.steps == 150
        assert job.training.local_batch_size == 2 and not job.validation.enable
        dumps.add(job.job.dump_folder)
    assert len(dumps) == len(commands)
    bad = [*commands[0][3:], "--optimizer.muon.backend", "auto:no-gramm"]
    with pytest.raises(ValueError, match="no-gramm"):
        check(commands[0][2], bad)
    assert sc.main(["--dry-run", "--backends", "eager", "--out", str(tmp_path)]) == 0
    assert "--optimizer.muon.backend eager" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_the_verdict_of_each_run():
    trained = "\n".join(step_line(s, f"{8 - s / 10:.5f}") for s in (1, 5, 10))
    diverged = "\n".join([step_line(1, "8.1"), step_line(35, "6.87"), step_line(40, "nan")])
    rows = [
        sc.verdict("auto", diverged, 0),
        sc.verdict("eager", trained, 0),
        sc.verdict("plain", trained, 124),
        sc.verdict("auto:no-gram", "Traceback: ...", 1),
    ]
    assert rows[0]["status"] == "diverged (non-finite loss from step 40)"
    assert rows[1]["status"] == "trained" and rows[1]["last_step"] == 10
    assert rows[1]["last_loss"] == pytest.approx(7.0)
    assert rows[2]["status"] == "failed (exit 124)" and rows[3]["status"] == "failed (exit 1)"
    text = sc.table(rows)
    assert "| auto | diverged (non-finite loss from step 40) | 40 | nan |" in text
    assert "| eager | trained | 10 | 7.0000 |" in text
