"""Smoke test of scripts/bench_comm.py: a tiny run at world size 2 (gloo, spawned)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- bench_comm:start -->"


def bench(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_comm.py"), *argv],
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(200)
def test_bench_comm_moves_exactly_the_minimum(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nother section\n")
    rows_path = tmp_path / "rows.json"
    argv = ["--world-sizes", "2", "--dim", "32", "--layers", "1", "--steps", "1", "--warmup", "0"]
    out = bench(*argv, "--results", str(results), "--json", str(rows_path))
    assert "| 2 | fsdp |" in out
    rows = json.loads(rows_path.read_text())
    assert {r["layout"] for r in rows} == {"fsdp", "tp", "replicate", "ddp", "experts"}
    for r in rows:
        assert r["sent_mean"] == r["minimum_mean"], r
        assert sum(r["matrices_per_rank"]) == r["matrices"], r
    assert next(r for r in rows if r["layout"] == "experts")["sent_max"] == 0
    text = results.read_text()
    assert "other section" in text and MARK in text and "| 2 | fsdp |" in text
    # A second run replaces its own section instead of appending another.
    bench(*argv, "--results", str(results))
    assert results.read_text().count(MARK) == 1
