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

A name can take features away from a backend: ``"auto:no-gram"``, ``"auto:no-graphs,no-tma"``
(features: ``triton``, ``gram``, ``half``, ``graphs``, ``tma``; see
:class:`~muon_plugin.orthogonalize.paths.Features`). ``"auto:no-triton"`` also keeps the
elementwise kernels off; a registered backend that does not run the built-in iteration takes
``no-triton`` only (its elementwise kernels). The name, modifiers included, is what the plan
report shows. :func:`with_overrides` adds the features the environment switches off
(``MUON_PLUGIN_DISABLE_TRITON=1``, ``MUON_PLUGIN_DISABLE_GRAM=1``,
``MUON_PLUGIN_DISABLE_CUDA_GRAPHS=1``, ``MUON_PLUGIN_SYRK_TMA=0``), which the optimizer reads
once, at its construction, and a one-off call (``zeropower``, ``orthogonalize_stack``) when it
is made: the backend name is the one way to choose a path, and nothing reads the environment
while a step runs.
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
from muon_plugin.errors import SettingError
from muon_plugin.kernels import triton_available
from muon_plugin.orthogonalize.coefficients import Schedule, coefficient_schedule
from muon_plugin.orthogonalize.graphs import GraphedOrthogonalization, use_cuda_graph
from muon_plugin.orthogonalize.iterations import IterationPath, run_iteration
from muon_plugin.orthogonalize.paths import (
    FEATURE_NAMES,
    Features,
    ResolvedPath,
    iteration_path,
)
from muon_plugin.orthogonalize.spec import MatrixSpec, run_stack

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
        """Whether the elementwise Triton kernels may run next to this backend."""
        return triton_available()

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
        return iteration_path(batch, m, n, device, self.features, gram_space, graphed)

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
        graph = self.features.graphs and use_cuda_graph(device, stack, math.prod(shape), spec)
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
        return self.features.triton and triton_available()

    def without(self, off: frozenset[str]) -> IterationBackend:
        """This backend less the features named in ``off``."""
        reduced = copy.copy(self)
        reduced.features = self.features.without(off)
        return reduced


class _WithoutElementwiseKernels(Backend):
    """A registered backend that does not run the built-in iteration, with ``no-triton``: the
    same backend, the elementwise kernels off."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def resolve(self, *args: Any, **kwargs: Any) -> ResolvedPath:
        return self.inner.resolve(*args, **kwargs)

    def orthogonalize(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.inner.orthogonalize(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.inner.run(*args, **kwargs)

    def runner(self, *args: Any, **kwargs: Any) -> Callable[[Stack], Tensor]:
        return self.inner.runner(*args, **kwargs)

    def elementwise_kernels(self) -> bool:
        return False

    def without_graphs(self) -> Backend:
        return _WithoutElementwiseKernels(self.inner.without_graphs())


def _schedule(spec: MatrixSpec) -> Schedule:
    coefficients = None if spec.coefficients is None else tuple(spec.coefficients)
    # Under torch.compile the uncached function: Dynamo traces through a cache wrapper anyway
    # (the schedule becomes constants of the graph) and warns about it on every compile.
    cached = not torch.compiler.is_compiling()
    build = coefficient_schedule if cached else coefficient_schedule.__wrapped__
    return build(spec.strategy, spec.steps, coefficients)


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


_BY_NAME: dict[str, Backend] = {}  # every name asked for, modifiers included (a cache)


def backend_names() -> tuple[str, ...]:
    """The built-in backends, then the registered ones (names without modifiers)."""
    return tuple(_REGISTRY)


def _split(name: str) -> tuple[str, frozenset[str]]:
    """``"auto:no-gram,no-tma"`` -> ``("auto", {"gram", "tma"})``; ValueError naming what is
    wrong."""
    base, _, modifiers = name.partition(":")
    off = set()
    for modifier in filter(None, (m.strip() for m in modifiers.split(","))):
        feature = modifier.removeprefix("no-")
        if not modifier.startswith("no-") or feature not in FEATURE_NAMES:
            raise SettingError(
                "backend",
                f"unknown backend {name!r}: {modifier!r} is no modifier; expected 'no-<feature>' "
                f"with a feature of {FEATURE_NAMES}, e.g. 'auto:no-gram,no-tma'",
            )
        off.add(feature)
    if base not in _REGISTRY:
        raise SettingError(
            "backend", f"unknown backend {name!r}; expected one of {backend_names()}"
        )
    if ":" in name and not off:
        raise SettingError("backend", f"unknown backend {name!r}: no modifier after ':'")
    return base, frozenset(off)


def canonical_backend(name: str) -> str:
    """``name`` with its modifiers sorted (the name a plan report shows)."""
    base, off = _split(name)
    return base + (":" + ",".join(f"no-{f}" for f in sorted(off)) if off else "")


def validate_backend(name: Any) -> None:
    """Raise ValueError naming ``backend`` and the known names unless ``name`` is one (with
    modifiers that apply to it)."""
    if not isinstance(name, str):
        raise SettingError(
            "backend", f"unknown backend {name!r}; expected one of {backend_names()}"
        )
    get_backend(name)


def register_backend(name: str, backend: Backend, *, replace: bool = False) -> None:
    """Add ``backend`` under ``name`` (``MatrixSpec(backend=name)`` then selects it).

    The built-in names cannot be taken; another registered name only with ``replace=True``.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a backend name must be a non-empty string without ':', got {name!r}")
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {name!r} must be a Backend, got {type(backend).__name__}")
    if name in BACKENDS or (name in _REGISTRY and not replace):
        raise ValueError(f"backend {name!r} is already registered; known: {backend_names()}")
    _REGISTRY[name] = backend
    _BY_NAME.clear()


def get_backend(name: str) -> Backend:
    """The backend named ``name``: a registered one, less the features its modifiers name
    (ValueError naming the known ones, or the modifier that does not apply)."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is not None:
        return found
    if not isinstance(name, str):
        raise SettingError(
            "backend", f"unknown backend {name!r}; expected one of {backend_names()}"
        )
    base, off = _split(name)
    backend = _REGISTRY[base]
    if off and isinstance(backend, IterationBackend):
        backend = backend.without(off)
    elif off:
        if off != {"triton"}:
            raise SettingError(
                "backend",
                f"unknown backend {name!r}: backend {base!r} does not run the built-in "
                "iteration; only 'no-triton' (its elementwise kernels) applies to it",
            )
        backend = _WithoutElementwiseKernels(backend)
    _BY_NAME[name] = backend
    return backend


def with_overrides(name: str, off: frozenset[str]) -> str:
    """The backend ``name`` less the features in ``off`` (the environment's overrides, see
    the module docstring), as a canonical name; ``name`` itself when nothing changes. For a
    backend that does not run the built-in iteration, only ``triton`` applies."""
    base, own = _split(name)
    if not isinstance(_REGISTRY[base], IterationBackend):
        off = off & {"triton"}
    if off <= own:
        return name
    return canonical_backend(f"{base}:" + ",".join(f"no-{f}" for f in sorted(own | off)))


def elementwise_kernels_allowed(name: str) -> bool:
    """Whether the elementwise Triton kernels (momentum, decay + update) may run for a group on
    backend ``name``: ``"auto"`` (and its variants without ``no-triton``) where triton imports;
    never for ``"cublas"``, ``"plain"`` or ``...:no-triton``. The optimizer asks at every step
    (a cached lookup) and passes it as ``enabled`` to
    ``muon_plugin.kernels.elementwise.kernel_groups``."""
    return get_backend(name).elementwise_kernels()
