"""The QK-Clip benchmarks run on a CPU: ``scripts/bench_qk_clip.py --quick`` (its rows and its
RESULTS.md section) and the ``muon+qk_clip`` entry of ``scripts/bench_titan_tps.py`` (a job
torchtitan accepts, with the benchmark flavor of four Llama-3-8B layers). Timings are not
judged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # configs.llama3_bench_model
sys.path.insert(0, str(ROOT / "scripts"))
import bench_qk_clip  # noqa: E402
import bench_titan_tps  # noqa: E402


def test_bench_qk_clip_quick_run_writes_its_section(tmp_path: Path, capsys) -> None:
    results = tmp_path / "RESULTS.md"
    assert bench_qk_clip.main(["--quick", "--reps", "1", "--results", str(results)]) == 0
    text = results.read_text()
    assert "<!-- bench_qk_clip:start -->" in text and "<!-- bench_qk_clip:end -->" in text
    for row in (
        "attention fwd+bwd (SDPA, one layer)",
        "statistic, FlexAttention path: not available here",
        "statistic (max logit per head, one layer), chunked path",
        "clip after the step (2 layers' wq, wk)",
        "model step, QK-Clip off (bench_tiny)",
        "model step, QK-Clip on (bench_tiny)",
    ):
        assert f"| {row} |" in text, text
    assert "| row | ms (median) | min-max | ratio |" in text
    clip = next(line for line in text.splitlines() if line.startswith("| clip after"))
    low, high = map(float, clip.split("|")[3].split("-"))
    assert 0 < low <= float(clip.split("|")[2]) <= high  # the median inside its spread


def test_titan_tps_qk_clip_entry_is_a_valid_job() -> None:
    from muon_plugin.torchtitan.check import check

    assert bench_titan_tps.optimizer_args("muon", 100.0) == ["--optimizer.name", "muon"]
    qk = bench_titan_tps.optimizer_args("muon+qk_clip", 100.0)
    assert qk == ["--optimizer.name", "muon", "--optimizer.muon.qk_clip_tau", "100"]
    flavor = ["--experimental.custom_import", "configs.llama3_bench_model",
              "--model.name", "llama3_bench", "--model.flavor", "bench_8b_4l"]  # fmt: skip
    job = check(str(ROOT / "configs" / "llama3_8b_muon.toml"), [*qk, *flavor])
    assert job.optimizer.muon.qk_clip_tau == 100.0 and job.model.flavor == "bench_8b_4l"
    rows = [
        {"optimizer": "muon", "tps_median": 1000.0, "tps_min": 990.0, "tps_max": 1010.0,
         "steps_used": 5, "first_loss": 8.0, "last_loss": 7.0, "mem_gib": 10.0, "status": "ok"},
        {"optimizer": "muon+qk_clip", "tps_median": 970.0, "tps_min": 960.0, "tps_max": 980.0,
         "steps_used": 5, "first_loss": 8.0, "last_loss": 7.0, "mem_gib": 10.5, "status": "ok"},
    ]  # fmt: skip
    text, verdict = bench_titan_tps.table(rows, 0.95)
    assert "| muon+qk_clip | 970 |" in text
    assert verdict.startswith("Muon with QK-Clip / Muon tokens/s = 0.970.")
    section = bench_titan_tps.results_section("meta", text, verdict, 100.0)
    assert section.startswith("## torchtitan throughput, Muon with and without QK-Clip")
    assert "QK-Clip runs add `--optimizer.muon.qk_clip_tau 100`" in section
    assert "AdamW" not in section  # the AdamW target belongs to the AdamW vs Muon section
    assert "target is Muon within 5% of AdamW" in bench_titan_tps.results_section(
        "meta", text, verdict, None
    )


def test_bench_8b_4l_is_four_llama3_8b_layers() -> None:
    import configs.llama3_bench_model as bench_model

    args = bench_model.FLAVORS["bench_8b_4l"]
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (4096, 4, 32, 8)


def test_model_rows_build_the_flavor_for_the_benchmark_sequence() -> None:
    """The full shape's 8192 tokens are longer than the job's default sequence: the flavor's
    rotary table must be built for them (a 2048-long table fails the model's forward)."""
    import torchtitan.protocols.train_spec as tt_spec
    from torchtitan.config import JobConfig

    import configs.llama3_bench_model as bench_model

    spec = tt_spec.get_train_spec(bench_model.NAME)
    args = bench_qk_clip.model_args(spec, bench_qk_clip.FULL, JobConfig())
    assert args.max_seq_len == bench_qk_clip.FULL["seq"] == 8192
