"""scripts/profile_step.py's arithmetic on synthetic profiler events (the script needs a GPU), and
scripts/step_ab.py's alternating rounds on the CPU (a small workload)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import torch

from muon_plugin.row_state import ROW_STATE_KEY

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_step.py"


def load_script(path: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def event(name: str, start: float, end: float, cuda: bool = True, annotation: bool = False):
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    span = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return types.SimpleNamespace(
        name=name, device_type=device, time_range=span, is_user_annotation=annotation, thread=7
    )


def test_busy_time_is_the_union_of_kernel_intervals():
    script = load_script()
    assert script.busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert script.busy_us([]) == 0


def test_report_counts_kernels_only():
    script = load_script()
    events = [
        event("Optimizer.step#MuonForeach.step", 0, 100, annotation=True),  # a GPU-side range
        event("cpu op", 0, 50, cuda=False),
        event("gemm", 0, 40),
        event("gemm", 30, 60),  # overlaps the first on another stream
        event("copy", 70, 80),
    ]
    prof = types.SimpleNamespace(events=lambda: events)
    text = script.report(prof, steps=2, wall_ms=[0.2, 0.1], top=1)
    assert "GPU busy 0.035 ms" in text  # (60 + 10) us over 2 steps
    assert "summed over streams 0.040 ms" in text  # (40 + 30 + 10) / 2
    assert "2 kernels" in text  # 3 kernels over 2 steps, rounded
    lines = text.splitlines()
    assert lines[-2].endswith("gemm") and lines[-1].endswith("(others)")


def test_timeline_reads_the_last_steps_lead_gaps_and_tail():
    script = load_script()
    events = [
        event("Optimizer.step#MuonForeach.step", 0, 50, cuda=False),
        event("old", 10, 20),
        event("Optimizer.step#MuonForeach.step", 100, 150, cuda=False),
        event("momentum", 130, 200),
        event("graph a", 200, 260),
        event("graph b", 210, 240),  # overlaps a on another stream
        event("norm", 265, 290),  # 5 us after a
        event("update", 300, 400),  # 10 us after norm
    ]
    text = script.timeline(types.SimpleNamespace(events=lambda: events), gaps=1, tail=2)
    lines = text.splitlines()
    assert "first kernel at 30.0, last kernel done at 300.0" in lines[0]
    assert "15.0 us in 2 gaps" in lines[1]
    assert lines[2].split() == ["10.0", "us", "at", "190.0:", "norm", "->", "update"]
    assert lines[-1].split() == ["200.0", "100.0", "7", "update"]


def test_step_ab_alternates_rounds_and_prints_ratios(capsys, monkeypatch):
    script = load_script(SCRIPT.with_name("step_ab.py"))
    argv = ["step_ab.py", "--small", "--rounds", "3", "--steps", "1", "--warmup", "1"]
    monkeypatch.setattr("sys.argv", argv)
    script.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpt: 3 rounds of 1 steps, alternating")
    assert "foreach: median" in out[1] and "/ foreach" not in out[1]
    assert "normuon: median" in out[2] and "/ foreach: median" in out[2]


def test_every_optimizer_choice_builds_and_steps():
    """Each ``--optimizer`` choice builds on parameters shaped like the workloads' and steps
    (on the CPU here; the script profiles them on a GPU); NorMuon keeps its per-row state."""
    script = load_script()
    assert set(script.OPTIMIZERS) == {"foreach", "normuon", "lp-int8", "lp-int4", "turbo"}
    for name, build in script.OPTIMIZERS.items():
        if name == "lp-int8":
            try:
                import torchao  # noqa: F401
            except ImportError:
                continue
        params = [torch.nn.Parameter(torch.randn(48, 256)) for _ in range(2)]  # int4: 256 cols
        opt = build(params)
        for p in params:
            p.grad = torch.randn_like(p)
        before = [p.detach().clone() for p in params]
        opt.step()
        assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True)), name
        assert all((ROW_STATE_KEY in opt.state[p]) == (name == "normuon") for p in params), name
