"""The entry points: :func:`zeropower` (a batch of matrices) and :func:`orthogonalize_stack`
(a stack of whole parameter-shaped updates, the call the optimizer and the plan make).

Both resolve their path through a backend (``"auto"`` unless told otherwise) and run it; the
plan resolves once per shape group instead (:func:`resolve_path`) and runs the stored path
(:func:`run_path`). The backends themselves are in :mod:`muon_plugin.orthogonalize.backends`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from muon_plugin.orthogonalize.backends import (
    IterationBackend,
    Stack,
    get_backend,
    with_overrides,
)
from muon_plugin.orthogonalize.coefficients import EPS, Coefficients, coefficient_schedule
from muon_plugin.orthogonalize.iterations import IterationPath, run_iteration
from muon_plugin.orthogonalize.paths import ResolvedPath, environment_overrides
from muon_plugin.orthogonalize.spec import MatrixSpec, stack_shape


def zeropower(
    G: Tensor,
    steps: int = 5,
    strategy: str = "polar_express",
    *,
    scale: float = 1.0,
    eps: float = EPS,
    overwrite_input: bool = False,
    gram_space: bool | None = None,
    coefficients: Coefficients | None = None,
    backend: str = "auto",
    path: IterationPath | None = None,
) -> Tensor:
    """Approximate polar factor ``scale * U V^T`` of ``G`` (``..., m, n``), computed in bf16.

    Leading dimensions are a batch. ``scale`` is folded into the last step, so scaling the
    result costs nothing. The caller's tensor is left untouched unless ``overwrite_input`` is
    set and ``G`` is a contiguous bf16 scratch buffer, which may then be overwritten.
    ``coefficients`` replace the strategy's schedule (see :func:`coefficient_schedule`).

    The path is resolved by the built-in ``backend`` (``"auto"``, ``"cublas"`` or ``"plain"``)
    for ``G``'s shape and device, less the features the environment's overrides switch off
    (read now: a one-off call); ``gram_space`` forces Gram-space (True) or x-space (False)
    iteration on it, and an explicit ``path`` replaces the resolution altogether.
    """
    if G.ndim < 2:
        raise ValueError(f"zeropower needs a matrix or a batch of matrices, got {tuple(G.shape)}")
    schedule = coefficient_schedule(
        strategy, steps, None if coefficients is None else tuple(coefficients)
    )
    if path is None:
        m, n = sorted(G.shape[-2:])
        batch = math.prod(G.shape[:-2])
        path = iteration_backend(one_off(backend)).iteration_path(batch, m, n, G.device, gram_space)
    return run_iteration(G, schedule, path, scale=scale, eps=eps, overwrite_input=overwrite_input)


def orthogonalize_stack(
    X: Tensor | Sequence[Tensor],
    spec: MatrixSpec,
    out_dtype: torch.dtype | None = None,
    *,
    overwrite_input: bool = False,
    path: ResolvedPath | None = None,
) -> Tensor:
    """Orthogonalize a stack ``(B, *param_shape)`` of whole updates, scaled by the spec.

    ``X`` is a tensor or a sequence of same-shape tensors (stacked here into a bf16 scratch
    buffer, which is then normalized in place). Returns a bf16 tensor ``(B, *param_shape)``.
    Each matrix (or row block) is scaled by the spec's :meth:`~MatrixSpec.block_scale` of its
    own shape (the optimizer's learning-rate shape factor; 1 without ``output_scale``).
    ``out_dtype`` casts the whole stack once (one launch), which keeps the later multi-tensor
    update on its fast single-dtype path. ``overwrite_input`` lets a bf16 tensor ``X`` be used
    as that scratch buffer. The path is resolved by ``spec.backend`` for this stack (eagerly:
    graphs are the plan's), unless given.
    """
    if path is None:
        path = resolve_stack(X, spec)
    return run_path(path, X, spec, out_dtype, overwrite_input=overwrite_input)


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
    """The (eager) path of a one-off stack ``X`` (``B, *shape``), with the environment's
    overrides (read now)."""
    first = X if isinstance(X, Tensor) else X[0]
    shape = stack_shape(X)
    spec = replace(spec, backend=one_off(spec.backend))
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


def one_off(backend: str) -> str:
    """The backend a one-off call runs: ``backend`` less the features the environment's
    overrides switch off, read now."""
    return with_overrides(backend, environment_overrides())


def iteration_backend(name: str) -> IterationBackend:
    """The built-in (iterating) backend ``name``; TypeError for a backend that does not iterate."""
    backend = get_backend(name)
    if not isinstance(backend, IterationBackend):
        raise TypeError(f"backend {name!r} does not run the iteration (zeropower needs one)")
    return backend
