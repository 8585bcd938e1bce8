"""What is orthogonalized: :class:`MatrixSpec`, and the walk over a stack of whole updates.

:func:`run_stack` applies a spec (flattening, row blocks of fused weights, the learning-rate
shape rule) to a stack of parameter-shaped updates and hands each batch of matrices to a
backend's function; every backend shares it (see :mod:`muon_plugin.orthogonalize.backends`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from muon_plugin.orthogonalize.coefficients import EPS, Coefficients, lr_shape_factor

# (matrices (b, rows, cols), lr shape factor, may overwrite them) -> bf16 (b, rows, cols)
MatrixFunction = Callable[[Tensor, float, bool], Tensor]


@dataclass(frozen=True)
class RowNormalization:
    """NorMuon's stage after the orthogonalization (see :mod:`muon_plugin.orthogonalize.normuon`):
    the per-row second-moment EMA's ``beta2``, the ``eps`` added to its root, and the
    ``rescale`` rule (``muon_plugin.defaults.NORMUON_RESCALES``)."""

    beta2: float
    eps: float
    rescale: str


@dataclass(frozen=True)
class MatrixSpec:
    """How a parameter's update is orthogonalized; hashable, so it keys shape groups.

    ``split_sizes`` cut the rows (dim 0) into blocks orthogonalized independently (fused QKV);
    ``flatten`` views a >2-D parameter as ``(dim0, -1)`` (conv weights) instead of a batch of
    matrices over its leading dims. ``coefficients`` (one fixed quintic for every step) replace
    the strategy's schedule when set; ``eps`` bounds the input norm from below. ``backend``
    names the orthogonalization backend (``muon_plugin.defaults.BACKENDS`` or one added with
    :func:`~muon_plugin.orthogonalize.backends.register_backend`), resolved once per shape group.
    ``normalization`` (NorMuon), when set, normalizes the rows of each orthogonalized matrix on
    the rank that orthogonalized it; the backends ignore it.
    """

    steps: int = 5
    strategy: str = "polar_express"
    lr_adjust: str = "keller"
    flatten: bool = False
    split_sizes: tuple[int, ...] | None = None
    compile: bool = False
    coefficients: Coefficients | None = None
    eps: float = EPS
    backend: str = "auto"
    normalization: RowNormalization | None = None

    def matrix_view(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(batch, rows, cols)`` of the matrices a parameter of ``shape`` is made of."""
        if self.flatten:
            return 1, shape[0], math.prod(shape[1:])
        return math.prod(shape[:-2]), shape[-2], shape[-1]

    def row_blocks(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Row-block sizes of each matrix (one block unless ``split_sizes`` is set)."""
        _, rows, _ = self.matrix_view(shape)
        return self.split_sizes or (rows,)

    def block_batches(self, shape: tuple[int, ...], stack: int) -> list[tuple[int, int, int]]:
        """``(rows, cols, batch)`` of each batched call for a stack of ``stack`` parameters of
        ``shape``: one per distinct row-block size, in the order :func:`run_stack` makes them."""
        batch, rows, cols = self.matrix_view(shape)
        blocks = self.row_blocks(shape)
        if len(blocks) == 1:
            return [(rows, cols, stack * batch)]
        return [(size, cols, stack * batch * blocks.count(size)) for size in sorted(set(blocks))]

    def row_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the per-row state of a parameter of ``shape``: one entry per row of each of
        its matrices (``shape[:-1]``; ``(shape[0],)`` when flattened)."""
        return (shape[0],) if self.flatten else tuple(shape[:-1])

    def flops(self, shape: tuple[int, ...]) -> float:
        """Matmul FLOPs of orthogonalizing one parameter of ``shape`` (plain-matmul count)."""
        batch, _, cols = self.matrix_view(shape)
        total = 0.0
        for rows in self.row_blocks(shape):
            m, n = min(rows, cols), max(rows, cols)
            total += batch * self.steps * (4 * m * m * n + 2 * m**3)
        return total


def stack_bf16(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """Stack same-shape tensors into one bf16 buffer (one cast-while-copy launch).

    ``out``, if given, is that buffer (``(len(tensors), *shape)``, bf16); else a new one.
    """
    if out is None:
        first = tensors[0]
        shape = (len(tensors), *first.shape)
        out = torch.empty(shape, dtype=torch.bfloat16, device=first.device)
    return torch.stack(list(tensors), out=out)


def stack_shape(X: Tensor | Sequence[Tensor]) -> tuple[int, ...]:
    """``(B, *param_shape)`` of a stack given as a tensor or as same-shape pieces."""
    if isinstance(X, Tensor):
        return tuple(X.shape)
    return (len(X), *X[0].shape)


def run_stack(
    X: Tensor | Sequence[Tensor],
    spec: MatrixSpec,
    matrices: MatrixFunction,
    overwrite_input: bool = False,
) -> Tensor:
    """Orthogonalize a stack ``(B, *param_shape)`` of whole updates with ``matrices``; bf16.

    ``X`` is a tensor or a sequence of same-shape tensors (stacked here into a bf16 scratch
    buffer, which ``matrices`` may then overwrite). With ``overwrite_input`` a contiguous bf16
    tensor ``X`` is that scratch buffer itself (the caller's: no copy), and the result may come
    back in it. Each matrix (or row block) is handed over as a 3-D batch with the
    ``lr_shape_factor`` of its own shape, so ``param -= lr * result`` is the Muon update. Row
    blocks of one size share a shape and a scale: one call for them.
    """
    if isinstance(X, Tensor):
        scratch = overwrite_input and X.dtype == torch.bfloat16 and X.is_contiguous()
    else:
        X, scratch = stack_bf16(X), True
    param_shape = tuple(X.shape[1:])
    batch, rows, cols = spec.matrix_view(param_shape)
    M = X.reshape(X.size(0) * batch, rows, cols)
    blocks = spec.row_blocks(param_shape)
    if len(blocks) == 1:
        out = matrices(M, lr_shape_factor(rows, cols, spec.lr_adjust), scratch)
        return out.reshape(X.shape)
    out = torch.empty(M.shape, dtype=torch.bfloat16, device=M.device)
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    for size in sorted(set(blocks)):
        picked = [s for s, b in zip(starts, blocks, strict=True) if b == size]
        stacked = torch.stack([M[:, s : s + size] for s in picked], dim=1)
        factor = lr_shape_factor(size, cols, spec.lr_adjust)
        result = matrices(stacked.view(-1, size, cols), factor, True).reshape(stacked.shape)
        for j, s in enumerate(picked):
            out[:, s : s + size] = result[:, j]
    return out.reshape(X.shape)
