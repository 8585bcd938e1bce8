"""Resolved paths, and the rules by which the built-in backends choose them.

A :class:`ResolvedPath` says how one shape group's stacks are orthogonalized: per row-block
size an :class:`~muon_plugin.orthogonalize.iterations.IterationPath` (x-space or Gram space;
products in the Triton kernel, fp16 cuBLAS or the plain bf16 loop; TMA or pointer loads), and
whether the stack is replayed through a CUDA graph. A backend resolves it once per shape group
from the group's shape, stack size, device, dtype and spec; the run then makes no choices.

The built-in backends differ only in their :class:`Features`; :func:`iteration_path` and
:func:`use_gram_iteration` are the rules that turn features and a shape into a path. A backend
name can take features away (``"auto:no-gram,no-tma"``, see
:mod:`~muon_plugin.orthogonalize.backends`). The environment switches
(``MUON_PLUGIN_DISABLE_TRITON=1``, ``MUON_PLUGIN_DISABLE_GRAM=1``,
``MUON_PLUGIN_DISABLE_CUDA_GRAPHS=1``, ``MUON_PLUGIN_SYRK_TMA=0``) are overrides that take
features away the same way: :func:`environment_overrides` reads them, once per optimizer (at
its construction) or per one-off call, never while a step runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from muon_plugin.kernels import tma_supported
from muon_plugin.kernels import use_symmetric_kernel as kernel_wins
from muon_plugin.orthogonalize.iterations import IterationPath

DISABLE_TRITON = "MUON_PLUGIN_DISABLE_TRITON"
DISABLE_GRAM = "MUON_PLUGIN_DISABLE_GRAM"
DISABLE_CUDA_GRAPHS = "MUON_PLUGIN_DISABLE_CUDA_GRAPHS"
SYRK_TMA = "MUON_PLUGIN_SYRK_TMA"

ENVIRONMENT_SWITCHES: dict[str, tuple[str, str]] = {
    "triton": (DISABLE_TRITON, "1"),
    "gram": (DISABLE_GRAM, "1"),
    "graphs": (DISABLE_CUDA_GRAPHS, "1"),
    "tma": (SYRK_TMA, "0"),
}
"""feature -> (environment variable, the value that switches it off)."""

# Wide enough that skipping (n / m)-sized work pays for the extra m x m products (measured
# on an H200: see docs/performance.md).
GRAM_MIN_ASPECT = 2.0


@dataclass(frozen=True)
class Features:
    """What a built-in backend may use; each is used only where it pays (see the rules)."""

    triton: bool = True  # Triton symmetric kernels where they win; the scaling kernel (CUDA)
    gram: bool = True  # Gram-space iteration for wide matrices (CUDA)
    half: bool = True  # the fp16 cuBLAS Q-form where the kernel does not run (CUDA)
    graphs: bool = True  # CUDA graphs for small stacks
    tma: bool = True  # TMA loads and stores in the Triton kernel (Hopper)

    def without(self, off: frozenset[str]) -> Features:
        """These features less those named in ``off``."""
        return replace(self, **{name: False for name in off})


FEATURE_NAMES = tuple(f.name for f in fields(Features))


def environment_overrides() -> frozenset[str]:
    """The features the environment switches off (read now; see the module docstring)."""
    return frozenset(
        feature
        for feature, (variable, off) in ENVIRONMENT_SWITCHES.items()
        if os.environ.get(variable) == off
    )


def iteration_path(
    batch: int,
    m: int,
    n: int,
    device: torch.device,
    features: Features,
    gram_space: bool | None = None,
    graphed: bool = False,
) -> IterationPath:
    """The path of a batch of ``batch`` wide ``m x n`` matrices (``m <= n``) on ``device``.

    - Triton products where the kernel beats cuBLAS for that product's shape
      (:func:`~muon_plugin.kernels.use_symmetric_kernel`, told whether the batch is replayed
      from a CUDA graph): ``X X^T`` of ``(batch, m, n)`` and the ``m x m`` products of
      ``(batch, m, m)``, on CUDA;
    - Gram space on CUDA where ``n >= GRAM_MIN_ASPECT * m`` (:func:`use_gram_iteration`),
      unless ``gram_space`` says otherwise;
    - else, where the ``m x m`` products do not run in the kernel, the fp16 cuBLAS Q-form on
      CUDA, and the plain bf16 loop elsewhere;
    - the per-matrix scalings in the Triton scaling kernel on CUDA, whatever the products.
    """
    cuda = device.type == "cuda"
    triton = features.triton and cuda
    xx = triton and kernel_wins(m, n, batch, graphed, device)
    mm = triton and kernel_wins(m, m, batch, graphed, device)
    if gram_space is None:
        gram_space = features.gram and gram_space_wins(m, n, cuda)
    if mm:
        products = "triton"
    elif gram_space or (features.half and cuda):
        products = "fp16"
    else:
        products = "bf16"
    tma = (xx or mm) and features.tma and tma_supported(device)
    return IterationPath("gram" if gram_space else "x", products, xx, tma, scale_triton=triton)


def use_gram_iteration(X: Any) -> bool:
    """Whether the ``"auto"`` backend iterates the wide batch ``X`` (``..., m, n``) in Gram space.

    On CUDA where ``n >= GRAM_MIN_ASPECT * m``; never with ``MUON_PLUGIN_DISABLE_GRAM=1`` (read
    now: a one-off call). The ``m x m`` products run in the Triton kernel where it handles them
    (``a I + b R + c R^2`` summed in fp32, one rounding), else as fp16 cuBLAS products; either
    way the result is closer to the fp64 loop than the bf16 plain loop (tests). Not on the CPU
    (no fast fp16).
    """
    if "gram" in environment_overrides():
        return False
    m, n = X.shape[-2:]
    return gram_space_wins(m, n, bool(X.is_cuda))


def gram_space_wins(m: int, n: int, cuda: bool) -> bool:
    """The Gram-space rule of the built-in paths: wide enough (``n >= GRAM_MIN_ASPECT * m``),
    on CUDA (the CPU has no fast fp16)."""
    return cuda and n >= GRAM_MIN_ASPECT * m


@dataclass(frozen=True)
class ResolvedPath:
    """How one shape group's stacks are orthogonalized, resolved once by its backend.

    ``backend`` is the registered name; ``iterations`` holds ``(rows, path)`` per distinct
    row-block size (one entry unless ``split_sizes``; empty for a backend that does not
    iterate); ``graph`` replays the stack through a CUDA graph; ``detail`` is what a custom
    backend wants :meth:`describe` to say.
    """

    backend: str = ""
    iterations: tuple[tuple[int, IterationPath], ...] = ()
    graph: bool = False
    detail: str = ""

    def iteration(self, rows: int) -> IterationPath:
        """The iteration path of the row blocks of ``rows`` rows."""
        for size, path in self.iterations:
            if size == rows:
                return path
        raise KeyError(f"{self.describe()!r} has no iteration path for blocks of {rows} rows")

    def eager(self) -> ResolvedPath:
        """This path without the CUDA graph (a one-off call, the per-parameter driver)."""
        return replace(self, graph=False) if self.graph else self

    def describe(self) -> str:
        """Short text: ``"gram, triton(tma), graph"``, ``"x, bf16, eager"``, a custom detail."""
        if not self.iterations:
            return self.detail or self.backend
        labels = list(dict.fromkeys(path.describe() for _, path in self.iterations))
        return "; ".join(labels) + (", graph" if self.graph else ", eager")
