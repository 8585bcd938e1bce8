"""Orthogonalization: the approximate polar factor ``U V^T`` of a (batched) matrix.

Pure functions, no optimizer state. The modules, bottom up (each imports only those above it,
:mod:`muon_plugin.kernels` and :mod:`muon_plugin.defaults`):

- :mod:`~muon_plugin.orthogonalize.coefficients`: coefficient schedules of the strategies;
- :mod:`~muon_plugin.orthogonalize.iterations`: the iterations (:func:`iterate`,
  :func:`iterate_gram`, :class:`Normalization`) on an explicit :class:`IterationPath`;
- :mod:`~muon_plugin.orthogonalize.spec`: :class:`MatrixSpec` and the walk over a stack of
  whole updates (flattening, row blocks, the output scale of each block);
- :mod:`~muon_plugin.orthogonalize.paths`: :class:`ResolvedPath` and the rules that choose one;
- :mod:`~muon_plugin.orthogonalize.graphs`: CUDA-graphed stacks;
- :mod:`~muon_plugin.orthogonalize.backends`: the registry of named backends (``"auto"``,
  ``"cublas"``, ``"plain"``, :func:`register_backend`), resolved once per shape group;
- :mod:`~muon_plugin.orthogonalize.api`: :func:`zeropower` and :func:`orthogonalize_stack`,
  and :func:`resolve_path` / :func:`run_path` (the plan's: once per shape group, every step).
"""

from muon_plugin.orthogonalize.api import orthogonalize_stack, resolve_path, run_path, zeropower
from muon_plugin.orthogonalize.backends import (
    Backend,
    IterationBackend,
    backend_names,
    canonical_backend,
    elementwise_kernels_allowed,
    get_backend,
    register_backend,
    validate_backend,
    with_overrides,
)
from muon_plugin.orthogonalize.coefficients import (
    EPS,
    MAX_STEPS,
    NEWTON_SCHULZ_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY,
    Coefficients,
    Schedule,
    coefficient_schedule,
    validate_coefficients,
    validate_steps,
)
from muon_plugin.orthogonalize.graphs import GraphedOrthogonalization, use_cuda_graph
from muon_plugin.orthogonalize.iterations import (
    GRAM_RESTART_INTERVAL,
    GRAM_SCALE_CAP,
    IterationPath,
    Normalization,
    iterate,
    iterate_gram,
    run_iteration,
)
from muon_plugin.orthogonalize.paths import (
    GRAM_MIN_ASPECT,
    Features,
    ResolvedPath,
    environment_overrides,
    iteration_path,
    use_gram_iteration,
)
from muon_plugin.orthogonalize.spec import MatrixSpec, run_stack, stack_bf16

__all__ = [
    "EPS",
    "GRAM_MIN_ASPECT",
    "GRAM_SCALE_CAP",
    "MAX_STEPS",
    "NEWTON_SCHULZ_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY",
    "Backend",
    "Coefficients",
    "Features",
    "GraphedOrthogonalization",
    "IterationBackend",
    "IterationPath",
    "MatrixSpec",
    "Normalization",
    "ResolvedPath",
    "Schedule",
    "backend_names",
    "canonical_backend",
    "coefficient_schedule",
    "elementwise_kernels_allowed",
    "environment_overrides",
    "get_backend",
    "GRAM_RESTART_INTERVAL",
    "iterate",
    "iterate_gram",
    "iteration_path",
    "orthogonalize_stack",
    "register_backend",
    "resolve_path",
    "run_iteration",
    "run_path",
    "run_stack",
    "stack_bf16",
    "use_cuda_graph",
    "with_overrides",
    "use_gram_iteration",
    "validate_backend",
    "validate_coefficients",
    "validate_steps",
    "zeropower",
]
