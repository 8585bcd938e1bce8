"""scripts/benchmark.py (the package scripts/bench): every row of every section runs (tiny
shapes, in this process), and the pieces around the rows (selection, budget, repeats, merging,
the RESULTS.md section).

``every_row`` runs the whole script once, in-process, on the GPU when there is one and else on
the CPU, at matrix dims / 64 with one timed repeat, so that no row can break unseen. What cannot
run here is faked or skipped, each for the reason given where it is done: on the CPU the rows
meant for a GPU run on the torch paths; ``compile=True`` compiles with torch.compile's "eager"
backend (inductor takes minutes on a CPU); the peer libraries' rows are left to
``scripts/run_one_gpu.sh peers``, and one stand-in peer runs the generic peer row's code.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench import (  # noqa: E402
    ablations,
    cli,
    config,
    formatting,
    measure,
    memory,
    ortho,
    peers,
    report,
    runs,
    workloads,
)
from bench import step as step_section  # noqa: E402
from bench.row import Patched, Row, row_patch  # noqa: E402
from bench.rows import BF16_ROWS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_ONLY = {"CUDA graphs need a GPU", "the Triton kernel needs a GPU"}
"""Skip reasons of the rows meant for a GPU: on the CPU they run on the torch paths here."""
PEERS_ELSEWHERE = "a peer library: scripts/run_one_gpu.sh peers runs it (minutes of autotuning)"


def tiny_config(*_) -> config.Config:
    """Matrix dims / 64 (on a GPU / 16, the --quick sizes: no Triton tile narrower than 16),
    one layer per model, one warm-up and one timed step per row."""
    return config.Config(
        full=False, div=64 if DEVICE == "cpu" else 16, llama_layers=1, gpt_layers=1, peak_n=64,
        step_warmup=1, step_iters_large=1, step_iters_small=1, compile_row=True,
    )  # fmt: skip


def one_repeat(timer, fn, **_) -> float:
    """``Timer.bench`` with one timed call after the first (the script's own loops time for
    100 ms or more per figure)."""
    fn()
    timer.sync()
    return timer.time_step(fn)


@contextlib.contextmanager
def every_row_runnable() -> contextlib.AbstractContextManager[collections.Counter]:
    """The script at tiny sizes with each row runnable here (or skipped with a reason); yields
    how often the replacements of the timer and of ``free_memory`` were called (each patched
    where the script looks it up, so a count of 0 means the patch missed)."""
    from muon_plugin.orthogonalize import backends

    real_rows = step_section.optimizer_rows
    peer_names = {name for name, _, _ in peers.PEERS}
    calls: collections.Counter = collections.Counter()

    def rows(cfg):
        out = real_rows(cfg)
        for row in out:
            if row.skip in GPU_ONLY:
                row.skip = None  # the torch paths of the CPU
            if row.name in peer_names:
                row.make, row.skip = None, PEERS_ELSEWHERE
        return out

    def stand_in_peer(params, lr):
        return torch.optim.SGD(params, lr=lr)

    eager = functools.cache(
        lambda: torch.compile(backends._run_uncompiled, backend="eager", dynamic=False)
    )

    def timed_once(timer, fn, **kwargs) -> float:
        calls["bench"] += 1
        return one_repeat(timer, fn, **kwargs)

    def no_collection() -> None:
        calls["free_memory"] += 1

    peer = types.ModuleType("stand_in_peer")
    peer.Muon = stand_in_peer
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        # (not mock.patch.dict: on exit it would drop every module imported meanwhile)
        sys.modules["stand_in_peer"] = peer
        stack.callback(sys.modules.pop, "stand_in_peer", None)
        enter(mock.patch.object(peers, "GENERIC_PEERS", [("stand_in_peer", ["Muon"])]))
        enter(mock.patch.object(step_section, "optimizer_rows", rows))
        enter(mock.patch.object(cli, "make_config", tiny_config))
        enter(mock.patch.object(measure.Timer, "bench", timed_once))
        enter(mock.patch.object(backends, "_compiled_run", eager))
        # A full garbage collection after each row takes 0.3 s in this process; rows this
        # small leave nothing worth collecting.
        enter(mock.patch.object(measure, "free_memory", no_collection))
        yield calls


@pytest.fixture(scope="module")
def every_row(tmp_path_factory) -> tuple[int, dict, str, list[str], collections.Counter]:
    """(exit status, the --json file, stdout, the files of the run's folder, the calls of the
    patched timer and free_memory) of one run of every section on ``DEVICE``."""
    tmp = tmp_path_factory.mktemp("every_row")
    out = tmp / "rows.json"
    results_before = (ROOT / "RESULTS.md").read_bytes()
    printed = io.StringIO()
    argv = ["--device", DEVICE, "--compile", "--json", str(out)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy CPU, spinning threads cost more than they give here
    try:
        with every_row_runnable() as calls, contextlib.redirect_stdout(printed):
            status = cli.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert (ROOT / "RESULTS.md").read_bytes() == results_before, "rewrote RESULTS.md"
    return (
        status,
        json.loads(out.read_text()),
        printed.getvalue(),
        sorted(p.name for p in tmp.iterdir()),
        calls,
    )


def test_every_step_row_of_every_workload_prints_a_number(every_row) -> None:
    status, data, printed, files, calls = every_row
    assert status == 0, printed[-3000:]
    assert files == ["rows.json"] and "SUMMARY" in printed
    assert calls["bench"] > 0 and calls["free_memory"] > 0, calls  # the patches reached
    with every_row_runnable():
        names = [row.name for row in step_section.optimizer_rows(tiny_config())]
    step = [r for r in data["rows"] if r["section"] == "step"]
    names_run = list(dict.fromkeys(r["workload"] for r in step))
    div = tiny_config().div  # the patched sizes reached the run: one layer, dims / div
    assert names_run == [f"llama3-8b-1L/{div}", f"gpt-125m-1L/{div}", f"llama3-8b-1L/{div} bf16"]
    for workload in names_run:
        got = {r["name"]: r for r in step if r["workload"] == workload}
        bf16 = workload.endswith(" bf16")
        assert list(got) == [n for n in names if not bf16 or n in BF16_ROWS]
        for name, r in got.items():
            if name in {n for n, _, _ in peers.PEERS}:
                assert r["skipped"] == PEERS_ELSEWHERE
                continue
            assert "error" not in r and "skipped" not in r, r
            assert r["ms"] > 0 and r["first_step_ms"] > 0, r
        if not bf16:
            assert got["stand_in_peer.Muon"]["ms"] > 0
    # Every row's memory: one fp32 momentum buffer for Muon, two fp32 moments for AdamW.
    mem = {
        r["name"]: r
        for r in data["rows"]
        if r["section"] == "memory" and "bf16" not in r["workload"]
    }
    assert abs(mem["MuonForeach (polar_express)"]["state_bytes_per_param"] - 4.0) < 0.1
    assert abs(mem["AdamW(fused=True)"]["state_bytes_per_param"] - 8.0) < 0.1
    # NorMuon: the momentum plus one fp32 second moment per row (4 / cols bytes a parameter)
    assert 4.0 < mem["MuonForeach (NorMuon)"]["state_bytes_per_param"] < 4.5
    assert all("state_mib" in r for r in mem.values() if "skipped" not in r)
    for table in ("kernels:", "ortho:", "step:", "memory:"):
        assert f"\n{table}\n" in printed


def test_every_kernel_and_orthogonalization_row_prints_a_number(every_row) -> None:
    _, data, _, _, _ = every_row
    kernels = [r for r in data["rows"] if r["section"] == "kernels"]
    assert {r["kind"] for r in kernels} == {"gram", "epilogue"}
    assert all("error" not in r for r in kernels), kernels
    assert all(r["cublas_ms"] > 0 and r["gram_ms"] > 0 for r in kernels)
    if DEVICE == "cpu":  # the Triton kernel's columns need a GPU
        assert all(r["note"] == "triton kernel skipped: no CUDA" for r in kernels)
    else:
        assert all(r["triton_ms"] > 0 for r in kernels)
    ortho = [r for r in data["rows"] if r["section"] == "ortho"]
    assert all("error" not in r and r["ms"] > 0 and r["tflops"] > 0 for r in ortho), ortho
    assert {r["name"] for r in ortho} >= {
        "polar_express", "newton_schulz", "turbo_muon x4", "polar_express, plain bf16 loop",
        "naive eager NS (reference)",
    }  # fmt: skip
    # The accuracy columns: distance to the exact (fp64) polar factor on two kinds of input.
    assert all(0 < r["polar_err_gauss"] < 1 and 0 < r["polar_err_low_rank"] < 1 for r in ortho)
    default = [r for r in ortho if r["name"] == "polar_express"]
    assert default and all("as_accurate_as_plain" in r for r in default)
    if DEVICE == "cpu":  # the same loop as the plain one here; on a GPU the fast paths' accuracy
        # is claimed at the benchmark's sizes and tested in
        # tests/orthogonalize/test_orthogonalize.py
        assert all(r["as_accurate_as_plain"] for r in default)
    assert report.markdown_section(data["meta"], {"kernels": kernels, "ortho": ortho}, None)


def test_every_orthogonalization_variant_runs_here(monkeypatch) -> None:
    """ "polar_express, cuBLAS only" is listed where the Gram-space path runs (on a GPU); each
    variant runs on any device, on the backend its name says (chosen by name, as a user
    chooses it: an environment switch set around a call is not what selects it)."""
    monkeypatch.setattr(ortho, "use_gram_iteration", lambda G: True)
    G = torch.randn(32, 64, device=DEVICE)
    variants = ortho.ortho_variants(G, use_triton=True)
    assert [name for name, *_ in variants] == [
        "polar_express", "newton_schulz", "turbo_muon x4", "polar_express, plain bf16 loop",
        "polar_express, cuBLAS only", "naive eager NS (reference)",
    ]  # fmt: skip
    asked = []
    real = ortho.zeropower
    monkeypatch.setattr(
        ortho, "zeropower", lambda *a, **k: asked.append(k.get("backend", "auto")) or real(*a, **k)
    )
    for name, fn, _ in variants:
        assert torch.isfinite(fn(G).float()).all(), name
    assert asked == ["auto", "auto", "auto", "plain", "cublas"]


def test_a_row_patch_that_is_never_called_or_not_counted_is_an_error() -> None:
    """The rows that patch the code they time check that their patch ran; a context that
    yields anything but a Patched (what broke two rows on the GPU) is named."""
    cfg = tiny_config()
    device = torch.device("cpu")
    wl = workloads.make_workload("w", workloads.gpt_shapes(1, 64), device, 1)
    timer = measure.Timer(device)

    def row(context):
        make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
        return step_section.run_row(Row("r", "ours", make, context), wl, cfg, timer, True, False)

    class Target:
        unused = staticmethod(lambda: None)

    never = row(lambda: row_patch(Target, "unused", lambda: None))
    assert never["error"] == "RuntimeError: the row's patch of Target.unused was never called"
    raw = row(lambda: mock.patch.object(Target, "unused", lambda: None))
    assert raw["error"] == "TypeError: the row's context yields function, not Patched"
    gpu_only = Patched("x", on_cpu=False)
    gpu_only.verify(cuda=False)  # the CPU does not ask the patched code
    with pytest.raises(RuntimeError, match="patch of x was never called"):
        gpu_only.verify(cuda=True)


def test_results_written_only_with_results_option(tmp_path):
    """``--results PATH`` writes PATH's benchmark section; by default nothing is written."""
    assert cli.parse_args(["--quick"]).results is None
    assert cli.parse_args(["--results", "R.md"]).results == Path("R.md")


def test_results_section_is_replaced_in_place(tmp_path):
    """The script's RESULTS.md section is updated between its markers; the rest is kept."""
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nintro\n\n<!-- other:start -->\nother\n<!-- other:end -->\n")
    report.write_results(path, f"{report.MARK_START}\nfirst\n{report.MARK_END}\n")
    report.write_results(path, f"{report.MARK_START}\nsecond\n{report.MARK_END}\n")
    text = path.read_text()
    assert "intro" in text and "other" in text and "second" in text
    assert "first" not in text
    assert text.count(report.MARK_START) == 1


def test_repeats_report_medians_and_ranges():
    """``--repeats``: each child runs the same command in its own process; rows are matched by
    name across runs, numbers become medians with their range."""
    argv = ["scripts/benchmark.py", "--quick", "--repeats", "3", "--results=R.md", "--json", "x"]
    cmd = runs.child_command(argv, Path("/tmp/run0.json"))
    assert cmd[1] == str(ROOT / "scripts" / "benchmark.py")  # the command users run
    assert cmd[2:] == ["--quick", "--json", "/tmp/run0.json"]
    run = lambda ms, peak: [  # noqa: E731
        {"section": "step", "workload": "w", "name": "A", "ms": ms, "required": True},
        {"section": "memory", "workload": "w", "name": "A", "step_peak_mib": peak},
    ]
    rows = runs.aggregate([run(3.0, 10.0), run(1.0, 30.0), run(2.0, 20.0)])
    step = next(r for r in rows if r["section"] == "step")
    assert step["ms"] == 2.0 and step["ms_range"] == (1.0, 3.0) and step["runs"] == 3
    assert step["required"] is True  # flags are not averaged
    assert formatting.spread(step, "ms") == "2.000 (1.000-3.000)"
    mem = next(r for r in rows if r["section"] == "memory")
    assert mem["step_peak_mib"] == 20.0 and mem["step_peak_mib_range"] == (10.0, 30.0)


def test_peer_rows_say_why_a_peer_is_skipped(monkeypatch):
    """A peer row is skipped with its reason: the module that does not import, or no GPU."""
    import types

    import torch

    monkeypatch.setitem(sys.modules, "fake_peer", types.ModuleType("fake_peer"))
    monkeypatch.setattr(
        peers,
        "PEERS",
        [
            ("needs absent", ("fake_peer", "no_such_peer_module"), lambda ps: None),
            ("graph peer", ("fake_peer",), lambda ps: None),
        ],
    )
    monkeypatch.setattr(peers, "GENERIC_PEERS", [("fake_peer", ["Muon"])])
    rows = {r.name: r for r in peers.peer_rows()}
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
    x = torch.ones(1024, 1024, device="cuda")  # 4 MiB, present before the probe: not counted
    probe = memory.MemoryProbe(cuda=True)
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
    assert cli.main(["--merge", *paths, "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    (row,) = merged["rows"]
    assert row["ms"] == 2.0 and row["ms_range"] == [1.0, 3.0] and merged["meta"]["runs"] == 3
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main(["--merge", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not a benchmark --json file" in capsys.readouterr().err


def test_rows_and_workloads_select_what_runs(tmp_path, monkeypatch):
    """``--rows`` and ``--workloads`` run only the named step rows on the named workloads."""
    monkeypatch.setattr(measure, "free_memory", lambda: None)  # see every_row_runnable
    out = tmp_path / "rows.json"
    argv = ["--quick", "--device", "cpu", "--sections", "step,memory", "--json", str(out)]
    argv += ["--rows", "MuonForeach (polar,adamw", "--workloads", "gpt"]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    step = [r for r in rows if r["section"] == "step"]
    assert {r["name"] for r in step} == {"MuonForeach (polar_express)", "AdamW(fused=True)"}
    assert {r["workload"] for r in rows if r["section"] != "peak"} == {"gpt-125m-3L/16"}
    assert all("ms" in r for r in step)
    assert not json.loads(out.read_text())["meta"].get("partial")
    for bad in (["--workloads", "bert"], ["--budget", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_budget_and_partial_json(tmp_path, monkeypatch):
    """Rows after ``--budget`` are skipped (named so); with ``--json`` the file holds every
    finished row while the run goes on, so a run stopped from outside keeps them."""
    monkeypatch.setattr(measure, "free_memory", lambda: None)  # see every_row_runnable
    out = tmp_path / "rows.json"
    argv = ["--quick", "--device", "cpu", "--sections", "step", "--json", str(out)]
    argv += ["--workloads", "gpt", "--rows", "MuonForeach (polar,adamw,naive"]
    run_row = step_section.run_row
    seen: list[str] = []

    def stopped_at_the_third_row(row, *args):
        seen.append(row.name)
        if len(seen) == 3:
            raise KeyboardInterrupt  # the run is killed here
        return run_row(row, *args)

    monkeypatch.setattr(step_section, "run_row", stopped_at_the_third_row)
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)
    data = json.loads(out.read_text())
    assert data["meta"]["partial"] is True
    assert [r["name"] for r in data["rows"] if r["section"] == "step"] == seen[:2]
    assert all("ms" in r for r in data["rows"] if r["section"] == "step")

    monkeypatch.setattr(step_section, "run_row", run_row)
    # A microsecond: spent on the matmul peak measured before the first row.
    assert cli.main([*argv, "--budget", "1e-6"]) == 0
    step = [r for r in json.loads(out.read_text())["rows"] if r["section"] == "step"]
    assert len(step) == 3 and all(r["skipped"] == "time budget (--budget) spent" for r in step)


def test_pool_bytes_splits_default_and_graph_pools():
    """The memory column "kept between steps" reads a CUDA memory snapshot: segments of the
    default pool (id (0, 0)) and of CUDA graphs' private pools are counted apart."""
    snapshot = [
        {"segment_pool_id": (0, 0), "total_size": 2 << 20},
        {"segment_pool_id": (0, 1), "total_size": 20 << 20},
        {"segment_pool_id": [1, 0], "total_size": 4 << 20},  # lists, as the C++ side gives
        {"total_size": 1 << 20},  # no pool id: the default pool
    ]
    assert memory.pool_bytes(snapshot) == {"default": 3 << 20, "graphs": 24 << 20}


def test_cublas_ablation_row_narrows_the_dispatch_region_while_it_runs():
    """Inside the ablation row's context a graphed 48 x 768 x 768 stack (GPT-125M's) goes back
    to cuBLAS; outside it, and after, the graphed stack takes the Triton kernel and the eager
    one cuBLAS."""
    import torch

    from muon_plugin.orthogonalize.paths import Features, iteration_path

    gpu = torch.device("cuda", 0)  # resolution only: nothing runs on it
    graphed = iteration_path(48, 768, 768, gpu, Features(tma=False), graphed=True)
    eager = iteration_path(48, 768, 768, gpu, Features(tma=False))
    with ablations.cublas_below_m(1024):
        inside = iteration_path(48, 768, 768, gpu, Features(tma=False), graphed=True)
    assert (graphed.products, eager.products, inside.products) == ("triton", "fp16", "fp16")
    assert graphed.xx_triton and not inside.xx_triton
    assert iteration_path(48, 768, 768, gpu, Features(tma=False), graphed=True) == graphed


def test_torch_scaling_ablation_row_switches_the_kernel_off_while_it_runs():
    from muon_plugin.kernels import matrix_scale

    rule = matrix_scale._use_kernel
    with ablations.torch_matrix_scaling():
        assert matrix_scale._use_kernel is not rule
        assert not matrix_scale._use_kernel(None, True)
    assert matrix_scale._use_kernel is rule
