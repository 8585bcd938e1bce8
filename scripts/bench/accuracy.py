"""What the ``ortho`` section measures accuracy against: the fp64 run of each strategy's loop,
the exact polar factor (fp64), and a gradient-like input (low rank plus noise). Also used by
``scripts/polar_accuracy.py``."""

from __future__ import annotations

import torch

from muon_plugin.orthogonalize import coefficient_schedule


def low_rank_plus_noise(shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """A gradient-like input: rank min(m, n) / 32 with decaying singular values, plus 1% noise."""
    *batch, m, n = shape
    r = max(1, min(m, n) // 32)
    U = torch.randn(*batch, m, r, device=device, generator=gen)
    V = torch.randn(*batch, r, n, device=device, generator=gen)
    decay = torch.logspace(0, -2, r, device=device).view(*([1] * len(batch)), 1, r)
    low = (U * decay) @ V
    noise = torch.randn(shape, device=device, generator=gen)
    return low / low.norm() + 0.01 * noise / noise.norm()


def exact_polar(G: torch.Tensor) -> torch.Tensor:
    """The polar factor U V^T of G (thin SVD), in fp64 through the eigendecomposition of the
    smaller Gram matrix: (G G^T)^(-1/2) G."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    lam, V = torch.linalg.eigh(X @ X.mT)
    inv_sqrt = lam.clamp_min(lam.amax(-1, keepdim=True) * 1e-24).rsqrt()
    P = (V * inv_sqrt.unsqueeze(-2)) @ V.mT @ X
    return P.mT if tall else P


def float64_loop(G: torch.Tensor, strategy: str, steps: int = 5) -> torch.Tensor:
    """The intended map, run in fp64: normalize (turbo_muon: the rows of the wide orientation
    by the square roots of the absolute row sums of its Gram matrix), then the strategy's steps
    (tall: transposed)."""
    sched = coefficient_schedule(strategy, steps)
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    if sched.aol:
        X = X / (X @ X.mT).abs().sum(-1, keepdim=True).sqrt()
    else:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * sched.norm_safety)
    for a, b, c in sched.coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X
