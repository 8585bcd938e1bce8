"""Gram space stays orthogonal on ill-conditioned inputs: the momenta of rank-one gradients
over a Gaussian bulk, and decaying spectra.

The accumulated ``Q`` of the Gram-space iteration grows like the product of the steps' leading
coefficients in the directions of small singular values, and its fp16 rounding leaks the
dominant direction into them; restarting every 2 steps bounds it. With 3 steps between
restarts (the interval before) these inputs came out with largest singular values of 9 here,
20 to 45 at 768 x 2048, and non-finite where the products were mirrored from one triangle
(the Triton kernel's form), which made a training run diverge on a GPU. The products run here
as fp16 torch products (the cuBLAS form) and, emulated, as the kernel's mirrored ones.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_orthogonalize import kernel_like_gram

import muon_plugin.orthogonalize.iterations as iterations
from muon_plugin.orthogonalize import coefficient_schedule
from muon_plugin.orthogonalize.iterations import IterationPath, Normalization, iterate_gram

M, N = 256, 640
SIGMA_MAX = 1.15  # Polar Express ends at most about 1.13


def inputs() -> list[tuple[str, torch.Tensor]]:
    """``(name, (2, M, N) bf16)``: 1-3 dominant rank-one terms over a Gaussian bulk of three
    sizes, and spectra decaying as i^-1 and i^-2."""
    gen = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    cases = []
    for spikes, bulk in itertools.product((1, 2, 3), (0.3, 0.9, 3.0)):
        X = bulk * randn(2, M, N)
        for _ in range(spikes):
            X += (1 + randn(1).abs().item()) * (randn(2, M, 1) @ randn(2, 1, N))
        cases.append((f"{spikes} rank-one + {bulk} gauss", X))
    U = torch.linalg.qr(randn(2, M, M))[0]
    V = torch.linalg.qr(randn(2, N, M))[0]
    for p in (1, 2):
        cases.append((f"decay i^-{p}", (U * torch.arange(1, M + 1.0) ** -p) @ V.mT))
    return [(name, X.to(torch.bfloat16)) for name, X in cases]


def mirrored_gram(X, **kw):
    """The Triton kernel's product, emulated (:func:`kernel_like_gram`: fp32 sums, one
    rounding), with its upper triangle mirrored, as the kernel computes one triangle (a product
    of two commuting matrices is symmetric only in exact arithmetic)."""
    P = kernel_like_gram(X, **kw)
    return P.triu() + P.triu(1).mT


def largest_singular_values(restart_every: int | None) -> dict[str, float]:
    schedule = coefficient_schedule("polar_express", 5)
    out = {}
    for name, X in inputs():
        Y = iterate_gram(
            X,
            schedule.coefficients,
            normalize=Normalization(schedule.norm_safety),
            restart_every=restart_every,
            path=IterationPath("gram", "fp16"),
        )
        finite = bool(torch.isfinite(Y).all())
        out[name] = torch.linalg.matrix_norm(Y.double(), ord=2).max().item() if finite else 1e9
    return out


@pytest.fixture(params=["torch fp16 products", "mirrored products"])
def products(request, monkeypatch):
    if request.param == "mirrored products":
        monkeypatch.setattr(iterations, "gram", mirrored_gram)
    return request.param


def test_every_ill_conditioned_input_stays_orthogonal(products):
    sigmas = largest_singular_values(None)
    bad = {name: s for name, s in sigmas.items() if not s < SIGMA_MAX}
    assert not bad, f"{products}: largest singular values over {SIGMA_MAX}: {bad}"


def test_three_steps_between_restarts_was_the_cause(products):
    worst = max(largest_singular_values(3).values())
    assert worst > 5, f"{products}: 3 steps between restarts gave at most {worst:.3f}"
