"""scripts/run_one_gpu.sh, the one command of a GPU machine, in its CPU smoke mode (SMOKE=1).

One run of its default phases (tests, train, bench) with the smallest selections: one test, one
training step, two benchmark rows. The interpreter is a user's own (``PYTHON=``) whose torch
reports release 2.11.0 to scripts/prepare_data.py (its version reader faked; everything else is
this Python), so the train phase is the README's main job through ``PYTHON=`` with a torch other
than the pinned one, for real: it builds the corpus with one warning and trains. The summary's
reading of logs and benchmark files is also checked on hand-made ones (a cut phase, a row
without a number, a phase with no time left).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import one_gpu_summary  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bash scripts run on Linux")

SHIM = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("prepare_data", {script!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
real = module.installed_release
module.installed_release = lambda name: "2.11.0" if name == "torch" else real(name)
sys.exit(module.main(sys.argv[1:]))
"""
WRAPPER = """\
#!/usr/bin/env bash
# A user's python: torch 2.11.0 as scripts/prepare_data.py sees it.
if [[ "$1" == scripts/prepare_data.py ]]; then shift; exec {python} {shim} "$@"; fi
exec {python} "$@"
"""


def user_python(tmp: Path) -> Path:
    shim = tmp / "prepare_data_torch_2_11.py"
    shim.write_text(SHIM.format(script=str(ROOT / "scripts" / "prepare_data.py")))
    wrapper = tmp / "python"
    wrapper.write_text(WRAPPER.format(python=sys.executable, shim=shim))
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    tmp = tmp_path_factory.mktemp("one_gpu")
    out, data = tmp / "out", tmp / "data"
    out.mkdir()
    (out / "bench1.json").write_text("{}")  # an earlier call's run: kept, not reused
    train_args = ["--training.steps", "1", "--job.dump_folder", str(tmp / "run")]
    train_args += ["--training.dataset_path", f"{data}/corpus"]
    train_args += [
        "--model.hf_assets_path",
        f"{data}/tokenizer",
        "--metrics.disable_color_printing",
    ]
    env = dict(
        os.environ,
        SMOKE="1",
        OUT=str(out),
        PYTHON=str(user_python(tmp)),
        TESTS="tests/scripts/test_benchmark_smoke.py::test_pool_bytes_splits_default_and_graph_pools",
        TRAIN_ARGS=" ".join(train_args),
        DATA_DIR=str(data),
        NPROC="1",
        SECTIONS="step,memory",
        ROWS="MuonForeach (polar,AdamW",
        WORKLOADS="gpt",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    env.pop("SKIP_PREPARE_DATA", None)
    script = ROOT / "scripts" / "run_one_gpu.sh"
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=400, cwd=tmp
    )
    return proc, out, data


def test_smoke_runs_every_default_phase_and_sums_up(smoke) -> None:
    proc, out, data = smoke
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert summary in proc.stdout
    lines = summary.splitlines()
    status = {ln.split()[0]: ln.split()[1] for ln in lines if ln.startswith("  ") and ln[2] != " "}
    assert status == {"machine:": "sources", "tests": "PASS", "train": "PASS", "bench": "PASS"}
    assert any(ln.startswith("  machine: torch ") for ln in lines)
    # Which code ran: the commit, and a digest of the sources that does not rely on git.
    assert any(ln.startswith("  machine: commit ") for ln in lines)
    digest = next(ln.split()[-1] for ln in lines if ln.startswith("  machine: sources "))
    assert re.fullmatch("[0-9a-f]{12}", digest)
    assert "           1 passed in " in summary
    assert f"log: {out}/train.log, run logs: train_logs/" in summary
    assert list((out / "train_logs").glob("ranks/**/stdout.log"))
    # The user's torch: the corpus is built, with one warning naming what differs, then used.
    assert "           [prepare_data] warning: torch 2.11.0 (pinned: 2.13.0): " in summary
    assert json.loads((data / "manifest.json").read_text())["key"]["packages"]["torch"] == "2.11.0"
    assert "           steps 1-1 logged, loss " in summary
    assert "step 2/2, memory 2/2 rows with a number" in summary
    assert "gpt-125m-3L/16: step ms MuonForeach (polar_express) " in summary


def test_smoke_numbers_its_benchmark_runs_after_earlier_ones(smoke) -> None:
    _, out, _ = smoke
    rows = json.loads((out / "bench2.json").read_text())["rows"]
    step = {r["name"] for r in rows if r["section"] == "step"}
    assert step == {"MuonForeach (polar_express)", "AdamW(fused=True)"}, step
    merged = (out / "bench.txt").read_text()
    assert "bench1.json: not a benchmark --json file" in merged  # named, not silently merged
    phases = [line.split("\t")[0] for line in (out / "phases.tsv").read_text().splitlines()]
    assert phases == ["tests", "train", "bench"]


def write_bench(path: Path, rows: list[dict], gpu: str | None = "H100") -> None:
    path.write_text(json.dumps({"meta": {"gpu": gpu}, "rows": rows}))


def test_summary_fails_a_cut_phase_and_a_row_without_a_number(tmp_path: Path) -> None:
    (tmp_path / "phases.tsv").write_text(
        "tests\t124\t150\t150\nbench\t0\t90\t200\ntrain\t-1\t0\t120\n"
    )
    (tmp_path / "tests.log").write_text("....\n")
    step = {"section": "step", "workload": "w", "group": "ours"}
    write_bench(
        tmp_path / "bench.json",
        [
            {**step, "name": "A", "ms": 1.5},
            {**step, "name": "MuonForeach, cuBLAS below m = 1024", "error": "TypeError: x"},
            {**step, "name": "dion", "group": "peer", "skipped": "dion not importable"},
            {**step, "name": "MuonForeach(compile=True)", "skipped": "--no-compile"},
            {**step, "name": "late", "skipped": "time budget (--budget) spent"},
        ],
    )
    text, ok = one_gpu_summary.summary(tmp_path)
    assert not ok
    assert "  tests    CUT   150 s of 150 (exit 124)" in text
    assert "  train    NOT RUN  0 s of 120 (exit -1)" in text
    assert "WITHOUT A NUMBER: step: MuonForeach, cuBLAS below m = 1024 w: TypeError: x" in text
    assert "WITHOUT A NUMBER: step: late w: time budget (--budget) spent" in text
    assert "left out: MuonForeach(compile=True) (--no-compile), dion (dion not importable)" in text
    assert "step 1/5 rows with a number" in text and "  bench    FAIL" in text


def test_summary_counts_the_compiled_row_and_cpu_only_skips(tmp_path: Path) -> None:
    (tmp_path / "phases.tsv").write_text("bench\t0\t90\t200\ncompile\t0\t80\t300\n")
    step = {"section": "step", "workload": "w", "group": "ours"}
    compiled = {**step, "name": "MuonForeach(compile=True)"}
    write_bench(tmp_path / "bench1.json", [{**compiled, "skipped": "--no-compile"}])
    write_bench(tmp_path / "compile.json", [{**compiled, "ms": 2.0}])
    text, ok = one_gpu_summary.summary(tmp_path)
    assert ok and "w: MuonForeach(compile=True) 2.000 ms" in text, text
    # Without a GPU (SMOKE=1) a row that needs one is left out, not failed.
    gpu_only = {**step, "name": "no CUDA graphs", "skipped": "CUDA graphs need a GPU"}
    write_bench(tmp_path / "bench1.json", [{**step, "name": "A", "ms": 1.0}, gpu_only], gpu=None)
    assert one_gpu_summary.summary(tmp_path)[1]
    write_bench(tmp_path / "bench1.json", [{**step, "name": "A", "ms": 1.0}, gpu_only])
    assert not one_gpu_summary.summary(tmp_path)[1]


def test_a_kernel_that_fell_back_to_torch_ops_fails_its_phase(tmp_path: Path) -> None:
    """Its results stay right (the torch ops take over after one warning), so the benchmark
    prints every number; the check of a GPU machine names the kernel and fails."""
    (tmp_path / "phases.tsv").write_text("bench\t0\t90\t200\n")
    write_bench(
        tmp_path / "bench1.json", [{"section": "step", "workload": "w", "name": "A", "ms": 1.0}]
    )
    assert one_gpu_summary.summary(tmp_path)[1]
    warning = (
        "momentum.py:135: UserWarning: muon_plugin: the int4 momentum kernel failed "
        "(CompilationError: at 43:8: ...); using torch ops instead (same results)\n"
    )
    (tmp_path / "bench1.log").write_text(warning * 2)
    text, ok = one_gpu_summary.summary(tmp_path)
    assert not ok and "  bench    FAIL" in text
    line = "KERNEL FELL BACK TO TORCH OPS: the int4 momentum kernel (CompilationError, bench1.log)"
    assert text.count(line) == 1, text


def test_the_spectrum_and_stability_phases_check_every_backend(tmp_path: Path) -> None:
    """The spectrum and stability phases (not default ones) in SMOKE mode: update_spectrum.py on
    the CPU at small sizes, PASS, its rows for every backend kept in spectrum.json; the
    stability check's runs listed (--dry-run: training them is the GPU's work)."""
    out = tmp_path / "out"
    env = dict(os.environ, SMOKE="1", OUT=str(out), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    cmd = ["bash", str(ROOT / "scripts" / "run_one_gpu.sh"), "spectrum", "stability"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "  spectrum PASS" in proc.stdout and "  stability PASS" in proc.stdout
    listed = (out / "stability.log").read_text().splitlines()
    assert [ln.split("--optimizer.muon.backend ")[1].split()[0] for ln in listed] == [
        "auto", "eager", "auto:no-gram", "auto:no-triton"
    ]  # fmt: skip
    rows = json.loads((out / "spectrum.json").read_text())["rows"]
    assert {r["backend"] for r in rows} == {
        "auto",
        "eager",
        "auto:no-gram",
        "auto:no-triton",
        "plain",
    }
