"""NorMuon's row normalization (arXiv:2510.05491) of a stack of orthogonalized matrices.

The stage runs where a whole matrix is: on the rank that orthogonalized it, between the
orthogonalization and the update. For each matrix ``O`` of a stack (``m x n``, already scaled by
the spec's output scale ``s`` of its row block, the optimizer's learning-rate shape factor, as
:func:`~muon_plugin.orthogonalize.spec.run_stack` returns it), with the per-row second moment
``v`` (``m`` floats, fp32):

1. ``q_r = mean_c (O_rc / s)^2``: the mean square of row ``r`` of the unscaled update;
2. ``v_r <- beta2 * v_r + (1 - beta2) * q_r`` (no bias correction);
3. ``d_r = 1 / (sqrt(v_r) + eps)``: row ``r`` of the normalized update ``O^ = (O / s) * d``;
4. per row block (one unless ``split_sizes``): ``U = c * s * O^ / ||O^||_F``, where ``c`` is
   ``||O / s||_F`` (``"frobenius"``: the norm of Muon's update is kept) or ``sqrt(min(rows,
   cols))`` (``"rms"``: the norm of an exactly orthogonal matrix; with ``lr_adjust =
   "match_rms_adamw"`` the update RMS is 0.2, the paper's step 4).

So ``U_r = O_r * f_r`` with ``f_r = d_r * c / ||O^||_F``: one pass over ``O`` for the row sums
of squares, then vector math on ``m`` floats (``||O^||_F^2 = n * sum_r d_r^2 q_r`` needs no second
pass). The factors, not ``U``, leave this stage: the update step multiplies each row by its
factor as it applies the update (one fp32 product, fused into its kernel on GPUs), so no pass
writes ``U``. The rows are dim -2 of each matrix as stored (a ``torch.nn.Linear`` weight's output
features; each expert's matrix of a 3-D stack; a flattened parameter's dim 0). ``v`` is kept in
the unscaled units of the paper, so it does not depend on the scale (``lr_adjust``). A matrix
whose normalized update is zero (a zero gradient) gets a zero update, not ``0/0``.

Every statistic of a matrix is reduced over that matrix alone, so its factors depend only on
its own data, not on the stack it is in or the layout of its parameter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from muon_plugin.kernels.row_factors import row_factors_kernel_, row_sum_squares_kernel
from muon_plugin.orthogonalize.spec import MatrixSpec, RowNormalization

__all__ = ["normuon_factors_", "row_factors_", "scale_rows"]


def normuon_factors_(ortho: Tensor, v: Tensor, spec: MatrixSpec, kernel: bool = False) -> Tensor:
    """NorMuon's per-row factors for a stack ``ortho`` (``(S, *shape)``: orthogonalized parameters
    or matrices of ``spec``, bf16 values) with their second moments ``v`` (``(S,
    *spec.row_shape(shape))``, fp32, contiguous, updated in place).

    Returns the factors ``f`` (fp32, ``v``'s shape): the update is ``ortho * f`` per row
    (:func:`scale_rows`), which the optimizer's update step applies (fused into its kernel on
    GPUs), so ``ortho`` itself is only read, once. ``kernel``: the rows' sums of squares and steps
    1-4 in two Triton launches where they apply (:mod:`muon_plugin.kernels.row_factors`), else
    torch's reduction and vector ops.
    """
    norm = spec.normalization
    if norm is None:
        raise ValueError("normuon_factors_ needs a spec with a normalization")
    batch, m, n = spec.matrix_view(tuple(ortho.shape[1:]))
    stack = ortho.shape[0] * batch
    if v.numel() != stack * m or v.dtype != torch.float32 or not v.is_contiguous():
        raise ValueError(
            f"second moments of shape {tuple(v.shape)} ({v.dtype}) for {stack} matrices of "
            f"{m} rows (expected contiguous fp32)"
        )
    X = ortho.reshape(stack, m, n)
    # ||O_r||^2: one pass over the stack, accumulated in fp32 (no fp32 copy of it).
    sum_sq = row_sum_squares_kernel(X) if kernel else None
    if sum_sq is None:
        sum_sq = torch.linalg.vector_norm(X, dim=-1, dtype=torch.float32).square_()
    rows, blocks = v.view(stack, m), _blocks(spec, m, n)
    factors = None
    if kernel:
        frobenius = norm.rescale == "frobenius"
        factors = row_factors_kernel_(sum_sq, rows, blocks, n, norm.beta2, norm.eps, frobenius)
    if factors is None:
        factors = row_factors_(sum_sq, rows, blocks, n, norm)
    return factors.view(v.shape)


def scale_rows(U: Tensor, factors: Tensor) -> Tensor:
    """``U * f`` per row in fp32: ``U`` (``(..., rows, ...)``) times ``factors`` (the leading
    ``factors.dim()`` dims of ``U``, broadcast over the rest)."""
    return U.float() * factors.view(*factors.shape, *([1] * (U.dim() - factors.dim())))


def row_factors_(
    sum_sq: Tensor,
    v: Tensor,
    blocks: list[tuple[int, int, float]],
    cols: int,
    norm: RowNormalization,
) -> Tensor:
    """Steps 1-4 on the rows' sums of squares ``||O_r||^2`` (``(S, m)``, fp32, overwritten):
    update ``v`` in place and return each row's factor ``d_r * c / ||O^||_F`` (``(S, m)``).

    ``blocks``: ``(first row, rows, output scale)`` of each row block.
    """
    q = sum_sq
    for start, size, factor in blocks:
        q[:, start : start + size] *= 1.0 / (cols * factor * factor)  # mean square of O / s
    v.lerp_(q, 1.0 - norm.beta2)
    d = v.sqrt().add_(norm.eps).reciprocal_()
    hat = d.square().mul_(q)  # d_r^2 q_r: row r's share of ||O^||_F^2 / cols
    for start, size, _ in blocks:
        rows = slice(start, start + size)
        hat_norm = hat[:, rows].sum(-1, keepdim=True)
        if norm.rescale == "frobenius":
            target = q[:, rows].sum(-1, keepdim=True)
        else:
            target = torch.full_like(hat_norm, min(size, cols) / cols)
        # A zero matrix (zero gradient) gets a zero update; NaN stays NaN (skip_nonfinite).
        gain = torch.where(hat_norm == 0, 0.0, target / hat_norm).sqrt_()
        d[:, rows] *= gain
    return d


def _blocks(spec: MatrixSpec, m: int, n: int) -> list[tuple[int, int, float]]:
    """``(first row, rows, output scale)`` of each row block of an ``m x n`` matrix."""
    out, start = [], 0
    for size in spec.split_sizes or (m,):
        out.append((start, size, spec.block_scale(size, n)))
        start += size
    if start != m:
        raise ValueError(f"split_sizes {spec.split_sizes} do not add up to {m} rows")
    return out
