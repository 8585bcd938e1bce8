"""Orthogonalization backends: a registry of named ways to orthogonalize a stack.

A backend turns ``(matrix shape, stack size, device, dtype, spec)`` into a
:class:`~muon_plugin.orthogonalize.paths.ResolvedPath` once per shape group (the plan does it
when it is built, and stores the path on the group) and runs stacks through that path; its
``describe()`` (``"gram, triton(tma), graph"``) is in the plan report. Built-in backends,
named in ``muon_plugin.defaults.BACKENDS``:

- ``"auto"``: the fastest exact-enough path per shape group: Triton symmetric kernels where
  they beat cuBLAS, Gram-space iteration for wide matrices, the fp16 cuBLAS Q-form elsewhere on
  CUDA, CUDA graphs for small stacks; on the CPU the plain bf16 loop.
- ``"eager"``: ``"auto"`` without CUDA graphs. A graph keeps its stack's input, result and
  intermediates allocated between steps; on a model of many small matrices (GPT-125M) that is
  about 1.2x the momentum state more peak memory, for a step about 1.3x faster.
- ``"cublas"``: ``"auto"`` without Triton kernels (elementwise kernels included).
- ``"plain"``: the plain bf16 loop on torch matmuls everywhere: no Gram space, no fp16 Q-form,
  no CUDA graphs, no Triton kernels (the reference).

Adding one touches this module only: subclass :class:`Backend`, implement ``orthogonalize``
(``scale`` times the polar factor of a bf16 batch of matrices), optionally ``resolve`` (to
describe or choose a path), and call :func:`register_backend`; then ``MatrixSpec(backend=name)``
selects it.

Environment variables only supply defaults, read when a path is resolved (once per shape group
of a plan; once per direct ``zeropower`` / ``orthogonalize_stack`` call), never while a path
runs: ``MUON_PLUGIN_DISABLE_TRITON=1`` makes ``"auto"`` resolve like ``"cublas"`` (and turns the
elementwise kernels off, see :func:`elementwise_kernels_allowed`); ``MUON_PLUGIN_DISABLE_GRAM=1``,
``MUON_PLUGIN_DISABLE_CUDA_GRAPHS=1`` and ``MUON_PLUGIN_SYRK_TMA=0`` take Gram space, CUDA graphs
and TMA loads away from ``"auto"`` and ``"cublas"``. ``"plain"`` uses none of them anyway.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from muon_plugin.defaults import BACKENDS
from muon_plugin.kernels import triton_kernels_enabled
from muon_plugin.orthogonalize.coefficients import Schedule, coefficient_schedule
from muon_plugin.orthogonalize.graphs import GraphedOrthogonalization, use_cuda_graph
from muon_plugin.orthogonalize.iterations import IterationPath, run_iteration
from muon_plugin.orthogonalize.paths import Features, ResolvedPath, iteration_path
from muon_plugin.orthogonalize.spec import MatrixSpec, run_stack, stack_shape

Stack = Tensor | Sequence[Tensor]


class Backend:
    """An orthogonalization backend; subclasses implement :meth:`orthogonalize`.

    The defaults: :meth:`resolve` returns a path that only names the backend (no CUDA graph),
    :meth:`run` walks the stack with :func:`~muon_plugin.orthogonalize.spec.run_stack` and
    calls :meth:`orthogonalize` per batch of same-shape matrices, :meth:`runner` wraps
    :meth:`run` in a CUDA graph where the path says so, and the elementwise Triton kernels are
    allowed as for ``"auto"``. ``spec.compile`` is the built-in backends' business.
    """

    def resolve(
        self,
        shape: tuple[int, ...],
        stack: int,
        device: torch.device,
        dtype: torch.dtype,
        spec: MatrixSpec,
    ) -> ResolvedPath:
        """The path of stacks of ``stack`` units of ``shape`` (``dtype``, on ``device``)."""
        return ResolvedPath()

    def orthogonalize(
        self,
        M: Tensor,
        *,
        scale: float,
        spec: MatrixSpec,
        path: ResolvedPath,
        overwrite_input: bool,
    ) -> Tensor:
        """``scale`` times the polar factor of each matrix of ``M`` (``b, rows, cols``), in bf16.

        ``M`` may be overwritten when ``overwrite_input`` is set (a scratch buffer).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement orthogonalize")

    def run(
        self,
        path: ResolvedPath,
        X: Stack,
        spec: MatrixSpec,
        out_dtype: torch.dtype | None = None,
        *,
        overwrite_input: bool = False,
    ) -> Tensor:
        """Orthogonalize the stack ``X`` (``B, *shape``) on ``path``: bf16, or ``out_dtype``."""

        def matrices(M: Tensor, scale: float, overwrite: bool) -> Tensor:
            return self.orthogonalize(
                M, scale=scale, spec=spec, path=path, overwrite_input=overwrite
            )

        result = run_stack(X, spec, matrices, overwrite_input)
        return result if out_dtype is None else result.to(out_dtype)

    def runner(
        self,
        path: ResolvedPath,
        spec: MatrixSpec,
        out_dtype: torch.dtype | None = None,
        *,
        name: str = "",
        stream: torch.cuda.Stream | None = None,
        scratch: bool = False,
    ) -> Callable[[Stack], Tensor]:
        """``X -> run(path, X, spec, out_dtype)``, through a CUDA graph (on ``stream``) where
        ``path.graph``; ``name`` names the group in a capture-failure warning. ``scratch``: the
        stacks it is given are the caller's scratch buffers, overwritten (no copy) and perhaps
        holding the result."""
        run = functools.partial(
            self.run, path, spec=spec, out_dtype=out_dtype, overwrite_input=scratch
        )
        return GraphedOrthogonalization(run, name, stream) if path.graph else run

    def elementwise_kernels(self) -> bool:
        """Whether the elementwise Triton kernels may run next to this backend (read now)."""
        return triton_kernels_enabled()

    def without_graphs(self) -> Backend:
        """This backend resolving paths for stacks run eagerly (one-off calls, the per-unit
        plans); the default: itself, whose graph flag the caller then drops."""
        return self


class IterationBackend(Backend):
    """A built-in backend: the Newton-Schulz / Polar Express iteration with some features."""

    def __init__(self, features: Features) -> None:
        self.features = features

    def without_graphs(self) -> Backend:
        """The same features less CUDA graphs: an eager stack also gets the eager dispatch
        region of the symmetric kernel (a graphed stack's is wider)."""
        eager = copy.copy(self)
        eager.features = replace(self.features, graphs=False)
        return eager

    def iteration_path(
        self,
        batch: int,
        m: int,
        n: int,
        device: torch.device,
        gram_space: bool | None = None,
        graphed: bool = False,
    ) -> IterationPath:
        """The path of a batch of wide ``m x n`` matrices (see ``paths.iteration_path``)."""
        features = self.features.under_environment()
        return iteration_path(batch, m, n, device, features, gram_space, graphed)

    def resolve(
        self,
        shape: tuple[int, ...],
        stack: int,
        device: torch.device,
        dtype: torch.dtype,
        spec: MatrixSpec,
    ) -> ResolvedPath:
        """A graph for small CUDA stacks, and per row-block size the
        :func:`~muon_plugin.orthogonalize.paths.iteration_path` of its batch (the stack's
        matrices of that size; inside a graph the kernel's region is wider)."""
        features = self.features.under_environment()
        graph = features.graphs and use_cuda_graph(device, stack, math.prod(shape), spec)
        iterations = []
        for rows, cols, batch in spec.block_batches(shape, stack):
            m, n = sorted((rows, cols))
            iterations.append((rows, self.iteration_path(batch, m, n, device, graphed=graph)))
        return ResolvedPath(iterations=tuple(iterations), graph=graph)

    def orthogonalize(
        self,
        M: Tensor,
        *,
        scale: float,
        spec: MatrixSpec,
        path: ResolvedPath,
        overwrite_input: bool,
    ) -> Tensor:
        return run_iteration(
            M,
            _schedule(spec),
            path.iteration(M.size(-2)),
            scale=scale,
            eps=spec.eps,
            overwrite_input=overwrite_input,
        )

    def run(
        self,
        path: ResolvedPath,
        X: Stack,
        spec: MatrixSpec,
        out_dtype: torch.dtype | None = None,
        *,
        overwrite_input: bool = False,
    ) -> Tensor:
        """:meth:`Backend.run`, under ``torch.compile`` with ``spec.compile``."""
        if not spec.compile:
            return super().run(path, X, spec, out_dtype, overwrite_input=overwrite_input)
        result = _compiled_run()(self, path, X, replace(spec, compile=False))
        return result if out_dtype is None else result.to(out_dtype)

    def elementwise_kernels(self) -> bool:
        return self.features.triton and triton_kernels_enabled()


def _schedule(spec: MatrixSpec) -> Schedule:
    coefficients = None if spec.coefficients is None else tuple(spec.coefficients)
    return coefficient_schedule(spec.strategy, spec.steps, coefficients)


def _run_uncompiled(backend: Backend, path: ResolvedPath, X: Stack, spec: MatrixSpec) -> Tensor:
    return backend.run(path, X, spec)


@functools.cache
def _compiled_run() -> Callable[..., Tensor]:
    """A backend's ``run`` under ``torch.compile`` (built once, on first use)."""
    return torch.compile(_run_uncompiled, dynamic=False)


_AUTO = IterationBackend(Features())
_REGISTRY: dict[str, Backend] = {
    "auto": _AUTO,
    "eager": _AUTO.without_graphs(),
    "cublas": IterationBackend(Features(triton=False)),
    "plain": IterationBackend(
        Features(triton=False, gram=False, half=False, graphs=False, tma=False)
    ),
}
assert tuple(_REGISTRY) == BACKENDS, "muon_plugin.defaults.BACKENDS names the built-ins"


def backend_names() -> tuple[str, ...]:
    """The built-in backends, then the registered ones."""
    return tuple(_REGISTRY)


def validate_backend(name: Any) -> None:
    """Raise ValueError naming ``backend`` and the known names unless ``name`` is one."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; expected one of {backend_names()}")


def register_backend(name: str, backend: Backend, *, replace: bool = False) -> None:
    """Add ``backend`` under ``name`` (``MatrixSpec(backend=name)`` then selects it).

    The built-in names cannot be taken; another registered name only with ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend name must be a non-empty string, got {name!r}")
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {name!r} must be a Backend, got {type(backend).__name__}")
    if name in BACKENDS or (name in _REGISTRY and not replace):
        raise ValueError(f"backend {name!r} is already registered; known: {backend_names()}")
    _REGISTRY[name] = backend


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (ValueError naming the known ones otherwise)."""
    validate_backend(name)
    return _REGISTRY[name]


def resolve_path(
    shape: tuple[int, ...],
    stack: int,
    device: torch.device,
    dtype: torch.dtype,
    spec: MatrixSpec,
    graphs: bool = True,
) -> ResolvedPath:
    """The path of ``spec.backend`` for stacks of ``stack`` units of ``shape`` on ``device``;
    without ``graphs``, for stacks that will run eagerly."""
    backend = get_backend(spec.backend)
    if not graphs:
        backend = backend.without_graphs()
    path = backend.resolve(tuple(shape), stack, device, dtype, spec)
    return replace(path if graphs else path.eager(), backend=spec.backend)


def resolve_stack(X: Stack, spec: MatrixSpec) -> ResolvedPath:
    """The (eager) path of a one-off stack ``X`` (``B, *shape``)."""
    first = X if isinstance(X, Tensor) else X[0]
    shape = stack_shape(X)
    return resolve_path(shape[1:], shape[0], first.device, first.dtype, spec, graphs=False)


def run_path(
    path: ResolvedPath,
    X: Stack,
    spec: MatrixSpec,
    out_dtype: torch.dtype | None = None,
    *,
    overwrite_input: bool = False,
) -> Tensor:
    """Run the stack ``X`` on an already resolved ``path`` (eagerly)."""
    backend = get_backend(path.backend)
    return backend.run(path, X, spec, out_dtype, overwrite_input=overwrite_input)


def iteration_backend(name: str) -> IterationBackend:
    """The built-in (iterating) backend ``name``; TypeError for a backend that does not iterate."""
    backend = get_backend(name)
    if not isinstance(backend, IterationBackend):
        raise TypeError(f"backend {name!r} does not run the iteration (zeropower needs one)")
    return backend


def elementwise_kernels_allowed(name: str) -> bool:
    """Whether the elementwise Triton kernels (momentum, decay + update) may run for a group on
    backend ``name``: ``"auto"`` unless ``MUON_PLUGIN_DISABLE_TRITON=1`` (read now) or triton is
    missing; never for ``"cublas"`` and ``"plain"``. The optimizer asks at every step (a
    registry lookup), so the switch takes effect at the next step, and passes it as ``enabled``
    to ``muon_plugin.kernels.elementwise.kernel_groups``."""
    return get_backend(name).elementwise_kernels()
