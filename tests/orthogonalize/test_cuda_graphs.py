"""CUDA-graphed orthogonalization: when it applies (CPU-testable), and on a GPU that a replay
gives the eager result bit for bit, inside the optimizer too, and that a failed capture falls
back to eager execution."""

from __future__ import annotations

import functools

import pytest
import torch

from muon_plugin import MuonForeach
from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack, resolve_path
from muon_plugin.orthogonalize.graphs import (
    GRAPH_MAX_MATRIX_NUMEL,
    GRAPH_MAX_STACK_NUMEL,
    GraphedOrthogonalization,
    use_cuda_graph,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC = MatrixSpec()


def make_graphed(spec: MatrixSpec, name: str, stream=None) -> GraphedOrthogonalization:
    """What the plan's runner is for a graphed group: ``orthogonalize_stack`` in a graph."""
    return GraphedOrthogonalization(functools.partial(orthogonalize_stack, spec=spec), name, stream)


def test_graphs_only_for_small_cuda_stacks(monkeypatch):
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert use_cuda_graph(gpu, 48, 768 * 768, SPEC)
    assert use_cuda_graph(gpu, 4, GRAPH_MAX_MATRIX_NUMEL, SPEC)
    assert not use_cuda_graph(cpu, 48, 768 * 768, SPEC)
    assert not use_cuda_graph(gpu, 4, 4096 * 14336, SPEC)  # long enough to hide launches
    too_many = GRAPH_MAX_STACK_NUMEL // (1024 * 1024) + 1
    assert not use_cuda_graph(gpu, too_many, 1024 * 1024, SPEC)  # memory kept between steps
    assert not use_cuda_graph(gpu, 48, 768 * 768, MatrixSpec(compile=True))
    assert not use_cuda_graph(gpu, 48, 0, SPEC)
    # The backends resolve a group's graph with that rule, once, where the backend allows.
    unit = (768, 768)
    assert resolve_path(unit, 48, gpu, torch.float32, SPEC).graph
    assert not resolve_path(unit, 48, gpu, torch.float32, MatrixSpec(backend="plain")).graph
    no_graphs = MatrixSpec(backend="auto:no-graphs")
    assert not resolve_path(unit, 48, gpu, torch.float32, no_graphs).graph


def pieces(n: int, shape: tuple[int, int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", generator=g) for _ in range(n)]


@cuda
@pytest.mark.parametrize("on_side_stream", [False, True], ids=["current", "side"])
@pytest.mark.parametrize("shape", [(96, 96), (64, 256), (256, 64)], ids=str)
def test_replay_equals_eager_bitwise(shape, on_side_stream):
    stream = torch.cuda.Stream() if on_side_stream else None
    graphed = make_graphed(SPEC, "test", stream)
    for call in range(4):
        X = pieces(6, shape, seed=call)
        eager = orthogonalize_stack(X, SPEC)
        out = graphed(X)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        assert (graphed.captured is not None) == (call > 0)
        assert torch.equal(out, eager), f"call {call}"
    stacked = torch.stack(pieces(6, shape, seed=9)).to(torch.bfloat16)
    out = graphed(stacked)
    torch.cuda.current_stream().wait_stream(stream or torch.cuda.current_stream())
    assert torch.equal(out, orthogonalize_stack(stacked, SPEC))
    other = pieces(3, shape, seed=10)  # another stack size: eager, not the captured graph
    assert torch.equal(graphed(other), orthogonalize_stack(other, SPEC))


@cuda
def test_concurrent_replays_of_large_products_stay_exact():
    """GPT-125M-sized stacks, whose cuBLAS products use a workspace, replayed side by side on
    their own streams: each equals its eager result (a shared capture stream would race)."""
    shapes = [(48, (768, 768)), (12, (3072, 768)), (12, (768, 3072))]
    runners = [make_graphed(SPEC, f"group {i}", torch.cuda.Stream()) for i in range(len(shapes))]
    for call in range(3):
        inputs = [pieces(n, shape, seed=10 * call + i) for i, (n, shape) in enumerate(shapes)]
        outs = [run(X) for run, X in zip(runners, inputs, strict=True)]
        for run in runners:
            torch.cuda.current_stream().wait_stream(run.stream)
        for X, out in zip(inputs, outs, strict=True):
            assert torch.equal(out, orthogonalize_stack(X, SPEC)), f"call {call}"


@cuda
def test_failed_capture_falls_back_to_eager():
    def not_capturable(X, *, overwrite_input=False):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing
        return orthogonalize_stack(X, SPEC, overwrite_input=overwrite_input)

    graphed = GraphedOrthogonalization(not_capturable, "test group")
    X = pieces(4, (64, 64), seed=1)
    graphed(X)
    with pytest.warns(UserWarning, match="test group"):
        out = graphed(X)
    assert graphed.failed and graphed.captured is None
    assert torch.equal(out, orthogonalize_stack(X, SPEC))
    assert torch.equal(graphed(X), out)


@cuda
@pytest.mark.parametrize("d", [128, 768], ids=["small", "gpt-125m"])
def test_optimizer_with_graphs_matches_eager(monkeypatch, d):
    """Five steps of MuonForeach on GPT-like layers: capturing and replaying the graphs on side
    streams changes nothing. The eager run keeps the graphed groups' resolved paths (the
    symmetric kernel's region is wider inside a graph, so switching graphs off altogether
    may change which kernel runs) and only calls them without capture."""

    def run() -> list[torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(0)
        shapes = ([(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]) * 2
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
        opt = MuonForeach(params, lr=0.02, wd=0.01)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in params]

    graphed = run()
    captures = []
    monkeypatch.setattr(GraphedOrthogonalization, "_capture", lambda *a: captures.append(a))
    eager = run()
    assert captures  # every graphed group asked for a capture and ran eagerly instead
    for a, b in zip(graphed, eager, strict=True):
        assert torch.equal(a, b)
