"""AOL scaling (Turbo-Muon, arXiv:2512.04632): the input's rows scaled from its Gram matrix.

For a wide batch ``X`` (``m <= n``) with ``A = X X^T``, ``D = diag(1 / sqrt(sum_j |A_ij|))``
gives ``||D X||_2 <= 1`` (the AOL bound, arXiv:2208.03160): the guarantee that dividing by the
Frobenius norm gave, with the rows equilibrated, so small singular values start larger and the
iteration needs one step fewer. ``D X`` has the Gram matrix ``D A D``, so the first step reuses
``A`` instead of forming another product; the cost is a row sum and two diagonal scalings.

``D`` is not a scalar: the iteration approximates the polar factor of ``D X``, not of ``X``
(docs/design/turbo_aol.md measures the difference).
"""

from __future__ import annotations

import torch
from torch import Tensor


def aol_factors(gram32: Tensor, eps: float) -> Tensor:
    """``(B, 1, m)`` fp32 factors ``1 / max(sqrt(sum_j |A_ij|), eps)`` of the rows of a wide
    batch, from its Gram matrix ``A`` (``B, m, m``, fp32). ``eps`` bounds what a row is
    divided by from below (a zero row stays zero)."""
    row_sums = torch.linalg.vector_norm(gram32, ord=1, dim=-1, dtype=torch.float32)
    return row_sums.sqrt_().clamp_min_(eps).reciprocal_().unsqueeze(-2)


def scaled_gram(gram32: Tensor, factors: Tensor, dtype: torch.dtype, extra: float = 1.0) -> Tensor:
    """``extra * diag(f) A diag(f)`` of the fp32 Gram matrix ``A``, for factors ``f`` of shape
    ``(B, 1, 1)`` (one per matrix: ``A * (f^2 * extra)``) or ``(B, 1, m)`` (AOL), in a new
    ``dtype`` tensor. The last product is computed in fp32 and rounded once into it (the same
    bits as scaling in fp32 and casting after, one pass over ``A`` fewer); ``A`` itself may be
    overwritten (AOL's first product)."""
    out = torch.empty_like(gram32, dtype=dtype)
    if factors.size(-1) == 1:
        return torch.mul(gram32, factors * factors * extra, out=out)
    return torch.mul(gram32.mul_(factors.mT), factors * extra, out=out)


def scaled_rows(X: Tensor, factors: Tensor, dtype: torch.dtype) -> Tensor:
    """``diag(f) X`` for a batch ``X`` and factors ``(B, 1, m)``, in a new ``dtype`` tensor
    with ``X``'s strides (one pass)."""
    out = torch.empty_like(X, dtype=dtype)
    return torch.mul(X, factors.mT, out=out)


def aol_start(
    gram32: Tensor, X: Tensor, factors: Tensor, half: bool, fold: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The x-space loop's first step with AOL: ``(D A D, X, factors or None)`` from the fp32
    Gram matrix ``A`` (overwritten) and the factors ``D``. ``D A D`` comes back in the loop's
    dtype (fp16 with ``half``, else X's); ``X`` comes back as ``D X`` (with ``half`` a new fp16
    copy, else scaled in place) unless ``fold``, which returns ``X`` as it is and the factors,
    for the first ``Q`` (``X <- (Q D) X``: no ``m x n`` pass)."""
    first_gram = scaled_gram(gram32, factors, torch.float16 if half else X.dtype)
    if half:
        return first_gram, scaled_rows(X, factors, torch.float16), None
    if fold:
        return first_gram, X, factors
    X.mul_(factors.mT)
    return first_gram, X, None
