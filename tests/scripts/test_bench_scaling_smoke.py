"""Smoke tests of the multi-GPU run's scripts on CPU.

- scripts/bench_scaling.py: the driver launches torchrun (gloo) at N = 1 and 2 on the Llama-3-8B
  shapes / 32; the table has both rows, N = 2 moves exactly the minimum bytes, efficiency is set;
- scripts/bench_titan_tps.py: torchtitan's metric lines parse into per-step tps, and the
  Muon / AdamW verdict is computed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

MARK = "<!-- bench_scaling:start -->"


@pytest.mark.timeout(120)
def test_bench_scaling_world2_on_cpu(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nother section\n")
    rows_path = tmp_path / "rows.json"
    argv = [
        "--device", "cpu", "--world-sizes", "1,2", "--layers", "1", "--dim-div", "32",
        "--steps", "1", "--warmup", "0", "--layouts", "fsdp",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_scaling.py"), *argv,
         "--results", str(results), "--json", str(rows_path)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(rows_path.read_text())
    assert out["errors"] == []
    rows = {(r["world_size"], r["layout"]): r for r in out["rows"]}
    assert set(rows) == {(1, "single"), (2, "fsdp")}
    one, two = rows[1, "single"], rows[2, "fsdp"]
    assert one["matrices"] == two["matrices"] == 7
    assert one["sent_mean"] == 0 and one["efficiency"] == pytest.approx(1.0)
    assert two["sent_mean"] > 0 and two["sent_mean"] == two["minimum_mean"], two
    assert sum(two["matrices_per_rank"]) == 7 and min(two["matrices_per_rank"]) >= 1  # by FLOPs
    assert two["step_ms"] > 0 and 0 < two["efficiency"] == pytest.approx(
        one["step_ms"] / (2 * two["step_ms"])
    )
    text = results.read_text()
    assert "other section" in text and text.count(MARK) == 1
    assert "| 1 | single | 1 |" in text and "| 2 | fsdp | fsdp 2 |" in text
    assert "| 2 | fsdp |" in done.stdout


LOG = """\
[rank0]:[titan] 2026-12-02 10:00:01,000 - root - INFO - step:  1  loss: 10.8123  grad_norm:  2.1000  memory:  1.20GiB(2.00%)  tps: 1,000  tflops: 0.10  mfu: 0.01%
[rank0]:[titan] 2026-12-02 10:00:02,000 - root - INFO - step:  2  loss:  9.5000  grad_norm:  2.0000  memory:  1.30GiB(2.10%)  tps: 20,480  tflops: 1.20  mfu: 0.10%
[rank0]:[titan] 2026-12-02 10:00:03,000 - root - INFO - step:  3  loss:  9.0000  grad_norm:  1.9000  memory:  1.30GiB(2.10%)  tps: 20,000  tflops: 1.10  mfu: 0.10%
[rank0]:[titan] 2026-12-02 10:00:04,000 - root - INFO - step:  4  loss:  8.5000  grad_norm:  1.8000  memory:  1.30GiB(2.10%)  tps: 21,000  tflops: 1.20  mfu: 0.10%
"""  # noqa: E501


def test_titan_tps_log_parsing():
    from bench_titan_tps import parse_log, summarize, table

    steps = parse_log(LOG)
    assert sorted(steps) == [1, 2, 3, 4] and steps[2]["tps"] == 20480
    adam = summarize("AdamW", steps, skip=1)
    assert adam["steps_used"] == 3 and adam["tps_median"] == 20480
    assert adam["first_loss"] == pytest.approx(10.8123) and adam["mem_gib"] == pytest.approx(1.3)
    muon = dict(adam, optimizer="muon", tps_median=19456.0)
    adam["status"] = muon["status"] = "ok"
    text, verdict = table([adam, muon], target=0.95)
    assert "| AdamW | 20,480 |" in text and "| muon | 19,456 |" in text
    assert "= 0.950" in verdict and "meets" in verdict


def test_titan_tps_repeated_runs_combine_into_one_row():
    from bench_titan_tps import combine, parse_log, summarize, table

    base = summarize("muon", parse_log(LOG), skip=1)
    runs = [dict(base, tps_median=m, status="ok") for m in (19000.0, 21000.0, 20000.0)]
    row = combine(runs)
    assert row["runs"] == 3 and row["run_medians"] == [19000.0, 21000.0, 20000.0]
    assert (row["tps_median"], row["tps_min"], row["tps_max"]) == (20000.0, 19000.0, 21000.0)
    assert row["steps_used"] == 9 and row["status"] == "ok"
    text, _ = table([row], target=0.95)
    assert "runs' medians min-max" in text and "| muon | 20,000 | 19,000-21,000 | 3 | 9 |" in text
    assert combine(runs[:1]) is runs[0]  # one run: its own steps' spread
    failed = combine([*runs[:2], dict(base, tps_median=None, status="failed (rc 1)")])
    assert failed["status"] == "failed (rc 1)" and failed["tps_median"] == 20000.0
