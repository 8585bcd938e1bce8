"""CI smoke test: ``scripts/benchmark.py --quick`` runs on the CPU and reports every section."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmark.py"
CPU_SECTIONS = ("kernels", "ortho", "step", "memory")


def git_status() -> str | None:
    """``git status --porcelain`` of the repository, or None outside a git checkout."""
    try:
        proc = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def test_benchmark_quick_cpu(tmp_path):
    """``--quick`` (without ``--results``) writes no results file, here or in the checkout."""
    out = tmp_path / "rows.json"
    results_before = (ROOT / "RESULTS.md").read_bytes()
    status_before = git_status()
    # One intra-op thread: on a busy 2-core CI runner, spinning OpenMP threads cost far more
    # than they gain on these small shapes.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        cwd=tmp_path,  # the script must find muon_plugin by itself, and write nothing here
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = (proc.stdout[-4000:] + "\n" + proc.stderr[-4000:]).strip()
    assert proc.returncode == 0, tail
    assert "SUMMARY" in proc.stdout, tail
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"], "wrote more than --json"
    assert (ROOT / "RESULTS.md").read_bytes() == results_before, "--quick rewrote RESULTS.md"
    assert git_status() == status_before, "the benchmark changed the checkout"

    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["torch"] and meta["command"].startswith("python ")
    assert "--quick" in meta["command"]

    for section in CPU_SECTIONS:
        got = [r for r in rows if r.get("section") == section]
        ok = [r for r in got if "error" not in r and "skipped" not in r]
        assert ok, f"no successful rows for section {section!r}: {got}"

    step = [r for r in rows if r.get("section") == "step" and "ms" in r]
    names = {r["name"] for r in step}
    for required in (
        "MuonForeach (polar_express)",
        "MuonForeach (newton_schulz)",
        "MuonForeach (NorMuon)",
        "Muon (per-parameter)",
        "naive reference Muon",
        "AdamW(fused=True)",
        "MuonForeach elementwise only",
    ):
        assert required in names, f"missing step row {required!r}: {sorted(names)}"
    assert all(r["ms"] > 0 for r in step)
    workloads = {r["workload"] for r in step}
    assert len(workloads) == 3, workloads  # Llama and GPT-125M in fp32, Llama in bf16
    bf16 = {r["name"] for r in step if r["workload"].endswith(" bf16")}
    assert {"MuonForeach (polar_express)", "MuonForeach (NorMuon)", "AdamW(fused=True)"} <= bf16

    ortho = [r for r in rows if r.get("section") == "ortho" and "ms" in r]
    assert {r["name"] for r in ortho} >= {
        "polar_express",
        "newton_schulz",
        "polar_express, plain bf16 loop",
    }
    assert all(r["tflops"] > 0 and r["pct_peak"] > 0 for r in ortho)
    # The accuracy columns: distance to the exact (fp64) polar factor on two kinds of input;
    # the default path is never farther from it than the plain bf16 loop.
    assert all(0 < r["polar_err_gauss"] < 1 and 0 < r["polar_err_low_rank"] < 1 for r in ortho)
    default = [r for r in ortho if r["name"] == "polar_express"]
    assert default and all(r["as_accurate_as_plain"] for r in default)

    mem = [r for r in rows if r.get("section") == "memory" and "state_bytes_per_param" in r]
    by_name = {r["name"]: r["state_bytes_per_param"] for r in mem if "bf16" not in r["workload"]}
    # One fp32 momentum buffer for Muon, two fp32 moments for AdamW (fp32 params).
    assert abs(by_name["MuonForeach (polar_express)"] - 4.0) < 0.1
    assert abs(by_name["AdamW(fused=True)"] - 8.0) < 0.1
    # NorMuon: the momentum plus one fp32 second moment per row
    assert 4.0 < by_name["MuonForeach (NorMuon)"] < 4.1


def test_results_written_only_with_results_option(tmp_path):
    """``--results PATH`` writes PATH's benchmark section; by default nothing is written."""
    benchmark = load_script()
    assert benchmark.parse_args(["--quick"]).results is None
    assert benchmark.parse_args(["--results", "R.md"]).results == Path("R.md")


@functools.cache
def load_script():
    """scripts/benchmark.py as a module (imported once)."""
    spec = importlib.util.spec_from_file_location("_muon_benchmark_script", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = benchmark  # dataclasses look their module up
    spec.loader.exec_module(benchmark)
    return benchmark


def test_results_section_is_replaced_in_place(tmp_path):
    """The script's RESULTS.md section is updated between its markers; the rest is kept."""
    benchmark = load_script()
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nintro\n\n<!-- other:start -->\nother\n<!-- other:end -->\n")
    benchmark.write_results(path, f"{benchmark.MARK_START}\nfirst\n{benchmark.MARK_END}\n")
    benchmark.write_results(path, f"{benchmark.MARK_START}\nsecond\n{benchmark.MARK_END}\n")
    text = path.read_text()
    assert "intro" in text and "other" in text and "second" in text
    assert "first" not in text
    assert text.count(benchmark.MARK_START) == 1


def test_repeats_report_medians_and_ranges():
    """``--repeats``: each child runs the same command in its own process; rows are matched by
    name across runs, numbers become medians with their range."""
    benchmark = load_script()
    argv = ["scripts/benchmark.py", "--quick", "--repeats", "3", "--results=R.md", "--json", "x"]
    cmd = benchmark.child_command(argv, Path("/tmp/run0.json"))
    assert cmd[2:] == ["--quick", "--json", "/tmp/run0.json"]
    run = lambda ms, peak: [  # noqa: E731
        {"section": "step", "workload": "w", "name": "A", "ms": ms, "required": True},
        {"section": "memory", "workload": "w", "name": "A", "step_peak_mib": peak},
    ]
    rows = benchmark.aggregate([run(3.0, 10.0), run(1.0, 30.0), run(2.0, 20.0)])
    step = next(r for r in rows if r["section"] == "step")
    assert step["ms"] == 2.0 and step["ms_range"] == (1.0, 3.0) and step["runs"] == 3
    assert step["required"] is True  # flags are not averaged
    assert benchmark.spread(step, "ms") == "2.000 (1.000-3.000)"
    mem = next(r for r in rows if r["section"] == "memory")
    assert mem["step_peak_mib"] == 20.0 and mem["step_peak_mib_range"] == (10.0, 30.0)


def test_peer_rows_say_why_a_peer_is_skipped(monkeypatch):
    """A peer row is skipped with its reason: the module that does not import, or no GPU."""
    import types

    import torch

    benchmark = load_script()
    monkeypatch.setitem(sys.modules, "fake_peer", types.ModuleType("fake_peer"))
    monkeypatch.setattr(
        benchmark,
        "PEERS",
        [
            ("needs absent", ("fake_peer", "no_such_peer_module"), lambda ps: None),
            ("graph peer", ("fake_peer",), lambda ps: None),
        ],
    )
    monkeypatch.setattr(benchmark, "GENERIC_PEERS", [("fake_peer", ["Muon"])])
    rows = {r.name: r for r in benchmark.peer_rows()}
    assert rows["needs absent"].skip == "no_such_peer_module not importable (ModuleNotFoundError)"
    assert rows["fake_peer.Muon"].skip == "no class among ['Muon']"
    if torch.cuda.is_available():
        assert rows["graph peer"].skip is None and rows["graph peer"].make is not None
    else:
        assert rows["graph peer"].skip == "needs a GPU"


def test_memory_probe_counts_cuda_graph_pools():
    """Memory a captured graph holds between replays counts in the whole-run peak."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    benchmark = load_script()
    x = torch.ones(1024, 1024, device="cuda")  # 4 MiB, present before the probe: not counted
    probe = benchmark.MemoryProbe(cuda=True)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (x.repeat(16, 1) * 2).sum()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        y = (x.repeat(16, 1) * 2).sum()  # a 64 MiB temporary inside the graph's pool
    graph.replay()
    other, graphs = probe.kept_mib(state=0)
    assert graphs >= 64 and other < 64, (graphs, other)  # the pool, apart from the rest
    peak, held = probe.lifetime_mib()
    assert held >= 64 and peak >= 64, (peak, held)
    assert peak < 300, peak
    del graph, y


def test_merge_reports_saved_runs(tmp_path, capsys):
    """``--merge`` reports saved ``--json`` runs as medians with ranges; bad files are named."""
    import torch

    benchmark = load_script()
    meta = {
        "date": "d",
        "command": "python scripts/benchmark.py --json r.json",
        "gpu": None,
        "device": "cpu",
        "torch": torch.__version__,
        "triton": None,
        "sizes": "small",
    }
    for i, ms in enumerate((3.0, 1.0, 2.0)):
        rows = [{"section": "step", "workload": "w", "name": "A", "group": "ours", "ms": ms}]
        (tmp_path / f"r{i}.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    out = tmp_path / "merged.json"
    paths = [str(tmp_path / f"r{i}.json") for i in range(3)]
    assert benchmark.main(["--merge", *paths, "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    (row,) = merged["rows"]
    assert row["ms"] == 2.0 and row["ms_range"] == [1.0, 3.0] and merged["meta"]["runs"] == 3
    (tmp_path / "bad.json").write_text("{}")
    assert benchmark.main(["--merge", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not a benchmark --json file" in capsys.readouterr().err


def test_rows_and_workloads_select_what_runs(tmp_path):
    """``--rows`` and ``--workloads`` run only the named step rows on the named workloads."""
    benchmark = load_script()
    out = tmp_path / "rows.json"
    argv = ["--quick", "--device", "cpu", "--sections", "step,memory", "--json", str(out)]
    argv += ["--rows", "MuonForeach (polar,adamw", "--workloads", "gpt"]
    assert benchmark.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    step = [r for r in rows if r["section"] == "step"]
    assert {r["name"] for r in step} == {"MuonForeach (polar_express)", "AdamW(fused=True)"}
    assert {r["workload"] for r in rows if r["section"] != "peak"} == {"gpt-125m-3L/16"}
    assert all("ms" in r for r in step)
    assert not json.loads(out.read_text())["meta"].get("partial")
    for bad in (["--workloads", "bert"], ["--budget", "0"]):
        with pytest.raises(SystemExit):
            benchmark.parse_args(bad)


def test_budget_and_partial_json(tmp_path, monkeypatch):
    """Rows after ``--budget`` are skipped (named so); with ``--json`` the file holds every
    finished row while the run goes on, so a run stopped from outside keeps them."""
    benchmark = load_script()
    out = tmp_path / "rows.json"
    argv = ["--quick", "--device", "cpu", "--sections", "step", "--json", str(out)]
    argv += ["--workloads", "gpt", "--rows", "MuonForeach (polar,adamw,naive"]
    run_row = benchmark.run_row
    seen: list[str] = []

    def stopped_at_the_third_row(row, *args):
        seen.append(row.name)
        if len(seen) == 3:
            raise KeyboardInterrupt  # the run is killed here
        return run_row(row, *args)

    monkeypatch.setattr(benchmark, "run_row", stopped_at_the_third_row)
    with pytest.raises(KeyboardInterrupt):
        benchmark.main(argv)
    data = json.loads(out.read_text())
    assert data["meta"]["partial"] is True
    assert [r["name"] for r in data["rows"] if r["section"] == "step"] == seen[:2]
    assert all("ms" in r for r in data["rows"] if r["section"] == "step")

    monkeypatch.setattr(benchmark, "run_row", run_row)
    # A microsecond: spent on the matmul peak measured before the first row.
    assert benchmark.main([*argv, "--budget", "1e-6"]) == 0
    step = [r for r in json.loads(out.read_text())["rows"] if r["section"] == "step"]
    assert len(step) == 3 and all(r["skipped"] == "time budget (--budget) spent" for r in step)


def test_pool_bytes_splits_default_and_graph_pools():
    """The memory column "kept between steps" reads a CUDA memory snapshot: segments of the
    default pool (id (0, 0)) and of CUDA graphs' private pools are counted apart."""
    benchmark = load_script()
    snapshot = [
        {"segment_pool_id": (0, 0), "total_size": 2 << 20},
        {"segment_pool_id": (0, 1), "total_size": 20 << 20},
        {"segment_pool_id": [1, 0], "total_size": 4 << 20},  # lists, as the C++ side gives
        {"total_size": 1 << 20},  # no pool id: the default pool
    ]
    assert benchmark.pool_bytes(snapshot) == {"default": 3 << 20, "graphs": 24 << 20}


def test_cublas_ablation_row_narrows_the_dispatch_region_while_it_runs():
    """Inside the ablation row's context a graphed 48 x 768 x 768 stack (GPT-125M's) goes back
    to cuBLAS; outside it, and after, the graphed stack takes the Triton kernel and the eager
    one cuBLAS."""
    import torch

    from muon_plugin.orthogonalize.paths import Features, iteration_path

    benchmark = load_script()
    gpu = torch.device("cuda", 0)  # resolution only: nothing runs on it
    graphed = iteration_path(48, 768, 768, gpu, Features(tma=False), graphed=True)
    eager = iteration_path(48, 768, 768, gpu, Features(tma=False))
    with benchmark.cublas_below_m(1024):
        inside = iteration_path(48, 768, 768, gpu, Features(tma=False), graphed=True)
    assert (graphed.products, eager.products, inside.products) == ("triton", "fp16", "fp16")
    assert graphed.xx_triton and not inside.xx_triton
    assert iteration_path(48, 768, 768, gpu, Features(tma=False), graphed=True) == graphed


def test_torch_scaling_ablation_row_switches_the_kernel_off_while_it_runs():
    from muon_plugin.kernels import matrix_scale

    benchmark = load_script()
    rule = matrix_scale._use_kernel
    with benchmark.torch_matrix_scaling():
        assert matrix_scale._use_kernel is not rule
        assert not matrix_scale._use_kernel(None, True)
    assert matrix_scale._use_kernel is rule


def test_one_gpu_script_runs_and_merges_its_repeats(tmp_path):
    """``scripts/run_one_gpu.sh bench`` (SMOKE=1: on the CPU, --quick): each repeat its own
    process and JSON file, numbered after those already in $OUT, and the merged report."""
    env = dict(
        os.environ,
        SMOKE="1",
        OUT=str(tmp_path),
        PYTHON=sys.executable,
        REPEATS="2",
        ROWS="MuonForeach (polar,AdamW",
        BENCH_S="60",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    (tmp_path / "bench1.json").write_text("{}")  # an earlier call's run: kept, not reused
    script = ROOT / "scripts" / "run_one_gpu.sh"
    proc = subprocess.run(
        ["bash", str(script), "bench"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "benchmark run 2 rc=0" in proc.stdout and "benchmark run 3 rc=0" in proc.stdout
    for n in (2, 3):
        rows = json.loads((tmp_path / f"bench{n}.json").read_text())["rows"]
        step = {r["name"] for r in rows if r["section"] == "step"}
        assert step == {"MuonForeach (polar_express)", "AdamW(fused=True)"}, step
    merged = (tmp_path / "bench.txt").read_text()
    assert "bench1.json: not a benchmark --json file" in merged  # named, not silently merged
