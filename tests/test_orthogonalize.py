"""zeropower and orthogonalize_stack against exact SVD polar factors."""

from __future__ import annotations

import math

import pytest
import torch

from muon_plugin.orthogonalize import (
    MatrixSpec,
    coefficient_schedule,
    lr_shape_factor,
    orthogonalize_stack,
    zeropower,
)


def polar(G: torch.Tensor) -> torch.Tensor:
    """Exact polar factor U V^T (fp64 SVD), batched."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gradient_like(*shape: int, seed: int = 0) -> torch.Tensor:
    """A random matrix with a decaying spectrum, like a real gradient (not a Gaussian)."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -2, k, dtype=torch.float64)
    return ((U * s) @ V.mT).float()


SHAPES = [(64, 64), (48, 160), (160, 48), (3, 40, 96), (2, 2, 96, 40)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", ["polar_express", "newton_schulz"])
def test_zeropower_approximates_polar_factor(shape, strategy):
    G = gradient_like(*shape)
    out = zeropower(G, steps=8, strategy=strategy)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    err = rel_err(out, polar(G))
    # Newton-Schulz's quintic only reaches singular values in ~[0.7, 1.2]; Polar Express ~1%.
    assert err < (0.05 if strategy == "polar_express" else 0.3), err


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_polar_express_beats_newton_schulz_after_5_steps(shape):
    G = gradient_like(*shape, seed=1)
    ref = polar(G)
    pe = rel_err(zeropower(G, 5, "polar_express"), ref)
    ns = rel_err(zeropower(G, 5, "newton_schulz"), ref)
    assert pe < 0.8 * ns, (pe, ns)


def test_zeropower_matches_float64_iteration():
    """The bf16 loop computes the intended polynomial: compare with the same loop in fp64."""
    G = gradient_like(32, 80, seed=2)
    sched = coefficient_schedule("polar_express", 5)
    X = G.double() / (G.double().norm() * sched.norm_safety)
    for a, b, c in sched.coefficients:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    assert rel_err(zeropower(G, 5, "polar_express"), X) < 4e-2  # bf16 rounding over 5 steps


def test_zeropower_does_not_mutate_input():
    for dtype in (torch.bfloat16, torch.float32):
        G = gradient_like(40, 24, seed=3).to(dtype)
        before = G.clone()
        zeropower(G, 5)
        assert torch.equal(G, before)


def test_zeropower_of_zero_is_zero_not_nan():
    out = zeropower(torch.zeros(2, 16, 32), 5)
    assert torch.isfinite(out).all() and (out == 0).all()


def test_scale_is_folded_into_result():
    G = gradient_like(24, 64, seed=4)
    assert rel_err(zeropower(G, 5, scale=3.0), 3.0 * zeropower(G, 5).float()) < 1e-2


def test_lr_shape_rules():
    assert lr_shape_factor(4096, 1024, "keller") == pytest.approx(2.0)
    assert lr_shape_factor(1024, 4096, "keller") == 1.0
    assert lr_shape_factor(1024, 4096, "match_rms_adamw") == pytest.approx(0.2 * 64)
    assert lr_shape_factor(1024, 4096, "spectral") == pytest.approx(0.5)
    assert lr_shape_factor(7, 3, "none") == 1.0
    with pytest.raises(ValueError, match="lr_adjust"):
        lr_shape_factor(2, 2, "bogus")


@pytest.mark.parametrize("steps", [0, -1, 2.5, True, 100])
def test_bad_steps_rejected(steps):
    with pytest.raises(ValueError, match="ns_steps"):
        coefficient_schedule("polar_express", steps)


def test_unknown_strategy_rejected():
    with pytest.raises(ValueError, match="bogus"):
        zeropower(torch.randn(4, 4), 5, "bogus")


def test_polar_express_runs_past_its_table():
    G = gradient_like(32, 32, seed=5)
    assert rel_err(zeropower(G, 12), polar(G)) < 0.05


def test_split_sizes_orthogonalize_blocks_independently():
    """A fused QKV matrix with split_sizes equals its blocks handled as separate parameters."""
    spec = MatrixSpec(split_sizes=(32, 16, 16), lr_adjust="match_rms_adamw")
    X = gradient_like(64, 48, seed=6)
    fused = orthogonalize_stack(X[None], spec)[0]
    plain = MatrixSpec(lr_adjust="match_rms_adamw")
    parts = [orthogonalize_stack(X[None, a:b], plain)[0] for a, b in ((0, 32), (32, 48), (48, 64))]
    assert torch.equal(fused, torch.cat(parts))


def test_flatten_and_batched_views():
    X = gradient_like(1, 8, 36, seed=7).reshape(1, 8, 4, 9)
    flat = orthogonalize_stack(X, MatrixSpec(flatten=True, lr_adjust="none", steps=8))
    assert torch.equal(flat.reshape(8, 36), zeropower(X.reshape(8, 36), 8))
    assert rel_err(flat.reshape(8, 36), polar(X.reshape(8, 36))) < 0.05
    experts = gradient_like(3, 16, 24, seed=8)
    out = orthogonalize_stack(experts[None], MatrixSpec(lr_adjust="keller"))[0]
    for e in range(3):
        assert torch.equal(out[e], orthogonalize_stack(experts[e][None], MatrixSpec())[0])


def test_stack_applies_lr_shape_factor():
    X = gradient_like(96, 32, seed=9)
    out = orthogonalize_stack(X[None], MatrixSpec(lr_adjust="keller"))[0]
    assert rel_err(out, math.sqrt(3) * zeropower(X, 5).float()) < 1e-2


def test_fused_identity_form_matches_baddbmm_form(monkeypatch):
    """The Q = aI + bA + cA^2, X <- Q X form (used with the Triton kernel) is the same map.

    ``gram`` is replaced by an emulation of the kernel: fp32 accumulation and epilogue, then a
    single rounding to bf16.
    """
    import muon_plugin.orthogonalize as ortho

    def kernel_like_gram(X, *, alpha=1.0, C=None, beta=0.0, gamma=0.0):
        X32 = X.float()
        out = alpha * (X32 @ X32.mT) + gamma * torch.eye(X.shape[-2])
        if C is not None:
            out = out + beta * C.float()
        return out.to(X.dtype)

    for shape in [(48, 160), (160, 48), (2, 32, 32)]:
        G = gradient_like(*shape, seed=11)
        plain = zeropower(G, 5)
        monkeypatch.setattr(ortho, "kernel_handles", lambda A: True)
        monkeypatch.setattr(ortho, "gram", kernel_like_gram)
        fused = zeropower(G, 5, scale=1.5)
        monkeypatch.undo()
        assert fused.shape == G.shape
        assert rel_err(fused, 1.5 * plain.float()) < 3e-2
        assert rel_err(fused / 1.5, polar(G)) < 0.12
