"""CUDA graphs for orthogonalizing small stacks, whose launches cost more than their math.

Orthogonalizing one stack of matrices launches ~20 kernels (five iterations of two or three
products, plus normalization). For small matrices (a GPT-125M has 72 of at most 768 x 3072)
each kernel runs for tens of microseconds while its launch through PyTorch and cuBLAS costs
about as much host time, so an eager Muon step is bound by the host. A captured graph replays
the whole stack's kernels with one launch.

:class:`GraphedOrthogonalization` wraps a backend's stack function for one shape group (see
``Backend.runner`` in :mod:`muon_plugin.orthogonalize.backends`): the first call runs eagerly
(it autotunes the Triton kernels and warms cuBLAS), the second captures the call with a static
input buffer, and every later call copies its input into that buffer and replays. The math is
the same sequence of kernels, so results equal the eager ones. Whether a group is graphed is
part of its resolved path: on CUDA, for matrices of at most ``GRAPH_MAX_MATRIX_NUMEL`` elements
in stacks of at most ``GRAPH_MAX_STACK_NUMEL`` (the graph keeps its intermediates allocated
between steps, a few times the stack), see :func:`use_cuda_graph`. A capture that fails falls
back to eager execution for that group, with one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from muon_plugin.orthogonalize.spec import MatrixSpec, stack_bf16, stack_shape

# Matrices up to 2048 x 2048 (or 1024 x 4096): above that the products run long enough that
# launches overlap with them (measured on an H200: see docs/performance.md).
GRAPH_MAX_MATRIX_NUMEL = 2**22
# 256 MiB of bf16 input per stack: bounds the memory a graph keeps between steps.
GRAPH_MAX_STACK_NUMEL = 2**27

# ``run(X)`` or ``run(X, overwrite_input=True)``: the stack's bf16 result.
StackFunction = Callable[..., Tensor]


def use_cuda_graph(
    device: torch.device, stack_size: int, matrix_numel: int, spec: MatrixSpec
) -> bool:
    """Whether a stack of ``stack_size`` units with ``matrix_numel``-element matrices pays for a
    graph (the backends' rule; ``MUON_PLUGIN_DISABLE_CUDA_GRAPHS`` is applied by them). An
    empty stack (a rank that owns none of a group's matrices) has nothing to capture."""
    return (
        device.type == "cuda"
        and stack_size > 0
        and not spec.compile
        and 0 < matrix_numel <= GRAPH_MAX_MATRIX_NUMEL
        and stack_size * matrix_numel <= GRAPH_MAX_STACK_NUMEL
    )


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_input: Tensor  # (stack, *unit_shape), bf16; refilled before every replay
    output: Tensor  # written by every replay


class GraphedOrthogonalization:
    """``run(X)`` for one fixed stack shape, via a CUDA graph.

    ``run`` is a stack function (``run(X)``, and ``run(X, overwrite_input=True)`` on the
    graph's own input buffer). With a ``stream`` the graph is captured on it and every replay
    runs on it, after the input is copied on the caller's current stream, which must wait for
    ``stream`` before it reads the result; several runners on different streams overlap on the
    GPU. A graph is tied to its stream because cuBLAS bakes the stream's workspace into it: two
    graphs captured on one stream and replayed concurrently would share that workspace. The
    returned tensor is the graph's static output: it holds this call's result until the next
    call on the same object (the optimizer consumes it within the step). Inputs of another
    shape run eagerly.
    """

    def __init__(
        self, run: StackFunction, name: str, stream: torch.cuda.Stream | None = None
    ) -> None:
        self.run = run
        self.name = name
        self.stream = stream
        self.calls = 0
        self.failed = False
        self.captured: _Captured | None = None

    def __call__(self, X: Tensor | Sequence[Tensor]) -> Tensor:
        self.calls += 1
        shape = stack_shape(X)
        if self.failed or self.calls == 1:
            return self.run(X)
        if self.captured is None:
            self.captured = self._capture(X, shape)
            if self.captured is None:
                return self.run(X)
        elif tuple(self.captured.static_input.shape) != shape:
            return self.run(X)
        else:
            _fill(self.captured.static_input, X)
        if self.stream is None:
            self.captured.graph.replay()
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                self.captured.graph.replay()
        return self.captured.output

    def _capture(self, X: Tensor | Sequence[Tensor], shape: tuple[int, ...]) -> _Captured | None:
        first = X if isinstance(X, Tensor) else X[0]
        static_input = torch.empty(shape, dtype=torch.bfloat16, device=first.device)
        _fill(static_input, X)
        graph = torch.cuda.CUDAGraph()
        try:
            if self.stream is not None:
                # Warm up on the capture stream first (its cuBLAS handle and workspace are
                # created outside the graph's memory pool), as torch.cuda.graphs recommends.
                current = torch.cuda.current_stream(self.stream.device)
                self.stream.wait_stream(current)
                with torch.cuda.stream(self.stream):
                    self.run(static_input.clone())
                current.wait_stream(self.stream)
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                output = self.run(static_input, overwrite_input=True)
        except Exception as e:  # a capture failure must never stop training
            self.failed = True
            warnings.warn(
                f"muon_plugin: CUDA graph capture failed for {self.name} "
                f"({type(e).__name__}: {e}); orthogonalizing it eagerly from now on",
                stacklevel=3,
            )
            return None
        return _Captured(graph, static_input, output)


def _fill(static_input: Tensor, X: Tensor | Sequence[Tensor]) -> None:
    """Copy the stack (a tensor, or same-shape pieces cast while stacked) into the buffer."""
    if isinstance(X, Tensor):
        static_input.copy_(X)
    else:
        stack_bf16(X, out=static_input)
