"""zeropower and orthogonalize_stack against exact SVD polar factors."""

from __future__ import annotations

import math

import pytest
import torch

from muon_plugin.learning_rate import LrShapeRule, lr_shape_factor
from muon_plugin.orthogonalize import (
    IterationPath,
    MatrixSpec,
    coefficient_schedule,
    orthogonalize_stack,
    resolve_path,
    zeropower,
)

# Paths forced on the CPU (the products of the Triton ones emulated, see kernel_like_gram).
KERNEL = IterationPath("x", "triton", xx_triton=True)
KERNEL_GRAM = IterationPath("gram", "triton", xx_triton=True)
HALF = IterationPath("x", "fp16")
TORCH_GRAM = IterationPath("gram", "fp16")
ITERATIONS = "muon_plugin.orthogonalize.iterations.gram"  # what the iterations multiply with


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
    spec = MatrixSpec(split_sizes=(32, 16, 16), output_scale=LrShapeRule("match_rms_adamw"))
    X = gradient_like(64, 48, seed=6)
    fused = orthogonalize_stack(X[None], spec)[0]
    plain = MatrixSpec(output_scale=LrShapeRule("match_rms_adamw"))
    parts = [orthogonalize_stack(X[None, a:b], plain)[0] for a, b in ((0, 32), (32, 48), (48, 64))]
    assert torch.equal(fused, torch.cat(parts))


def test_flatten_and_batched_views():
    X = gradient_like(1, 8, 36, seed=7).reshape(1, 8, 4, 9)
    flat = orthogonalize_stack(
        X, MatrixSpec(flatten=True, output_scale=LrShapeRule("none"), steps=8)
    )
    assert torch.equal(flat.reshape(8, 36), zeropower(X.reshape(8, 36), 8))
    assert rel_err(flat.reshape(8, 36), polar(X.reshape(8, 36))) < 0.05
    experts = gradient_like(3, 16, 24, seed=8)
    out = orthogonalize_stack(experts[None], MatrixSpec(output_scale=LrShapeRule("keller")))[0]
    for e in range(3):
        assert torch.equal(out[e], orthogonalize_stack(experts[e][None], MatrixSpec())[0])


def test_stack_applies_lr_shape_factor():
    X = gradient_like(96, 32, seed=9)
    out = orthogonalize_stack(X[None], MatrixSpec(output_scale=LrShapeRule("keller")))[0]
    assert rel_err(out, math.sqrt(3) * zeropower(X, 5).float()) < 1e-2


def kernel_like_gram(
    X, *, Y=None, alpha=1.0, C=None, beta=0.0, gamma=0.0, out_dtype=None, kernel=None, tma=None
):
    """Emulates the Triton kernel: fp32 accumulation and epilogue, then one rounding."""
    X32 = X.float()
    Y32 = X32 if Y is None else Y.float()
    out = alpha * (X32 @ Y32.mT) + gamma * torch.eye(X.shape[-2])
    if C is not None:
        out = out + beta * C.float()
    return out.to(out_dtype or X.dtype)


def float64_polynomial(G: torch.Tensor, steps: int = 5, scale: float = 1.0) -> torch.Tensor:
    """The intended map in fp64: normalize, then the Polar Express steps (tall: transposed)."""
    sched = coefficient_schedule("polar_express", steps)
    X = G.double() / (G.double().norm(dim=(-2, -1), keepdim=True) * sched.norm_safety)
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    for a, b, c in sched.coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return scale * (X.mT if tall else X)


def test_fused_identity_form_matches_baddbmm_form(monkeypatch):
    """The Q = aI + bA + cA^2, X <- Q X form (used with the Triton kernel) is the same map.

    ``gram`` is replaced by an emulation of the kernel. That path also folds the input's
    normalization into the first step (norm from the Gram matrix's trace).
    """
    for shape in [(48, 160), (160, 48), (2, 32, 32)]:
        G = gradient_like(*shape, seed=11)
        plain = zeropower(G, 5)
        monkeypatch.setattr(ITERATIONS, kernel_like_gram)
        fused = zeropower(G, 5, scale=1.5, path=KERNEL)
        monkeypatch.undo()
        assert fused.shape == G.shape
        assert rel_err(fused, 1.5 * plain.float()) < 5e-2  # two bf16 roundings apart
        assert rel_err(fused / 1.5, polar(G)) < 0.12
        assert rel_err(fused, float64_polynomial(G, scale=1.5)) < 4e-2


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (2, 64, 64), (3, 32, 100)], ids=str)
def test_half_q_form_is_closer_to_fp64_than_bf16_loop(monkeypatch, shape):
    """The cuBLAS path on CUDA (fp16 Q-form, forced here on the CPU) is the same map, closer
    to the fp64 loop than the bf16 loop: fp16 keeps Q ~ I to 3 more bits."""
    G = gradient_like(*shape, seed=14) * 1e3  # unnormalized, as momentum is
    ref = float64_polynomial(G, scale=1.3)
    plain = zeropower(G, 5, scale=1.3, gram_space=False)
    out = zeropower(G, 5, scale=1.3, path=HALF)
    assert out.shape == G.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert rel_err(out, ref) < 0.75 * rel_err(plain, ref), (rel_err(out, ref), rel_err(plain, ref))


@pytest.mark.parametrize("emulate_kernel", [False, True], ids=["torch", "kernel-like"])
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (3, 32, 100), (24, 200)], ids=str)
def test_gram_space_iteration_matches_plain_loop(monkeypatch, shape, emulate_kernel):
    """Gram-space iteration (fp16 m x m matrices, restarts) computes the same polynomial map.

    Oracle: the plain loop in fp64. The Gram-space result must be as close to it as the bf16
    plain loop is (it is usually closer: its m x m products carry 3 more mantissa bits).
    """
    G = gradient_like(*shape, seed=12)
    ref = float64_polynomial(G, scale=0.7)
    plain_err = rel_err(zeropower(G, 5, scale=0.7, gram_space=False), ref)
    if emulate_kernel:
        monkeypatch.setattr(ITERATIONS, kernel_like_gram)
    out = zeropower(G, 5, scale=0.7, path=KERNEL_GRAM if emulate_kernel else TORCH_GRAM)
    if not emulate_kernel:  # what gram_space=True resolves to on the CPU
        assert torch.equal(out, zeropower(G, 5, scale=0.7, gram_space=True))
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    err = rel_err(out, ref)
    assert err < 1.25 * plain_err + 2e-3, (err, plain_err)
    assert rel_err(out / 0.7, polar(G)) < 0.12


def test_gram_space_restart_every_step_is_the_plain_q_form_loop(monkeypatch):
    """With a restart after every step the Gram-space loop is the Q-form loop (fp16 Q)."""
    import muon_plugin.orthogonalize as ortho

    monkeypatch.setattr(ITERATIONS, kernel_like_gram)
    G = gradient_like(2, 40, 120, seed=13)
    X = G.to(torch.bfloat16)
    X = X / (X.float().norm(dim=(-2, -1), keepdim=True) * 1.01).to(torch.bfloat16)
    coefficients = coefficient_schedule("polar_express", 6).coefficients
    every_step = ortho.iterate_gram(X, coefficients, restart_every=1)
    q_form = ortho.iterate(X, coefficients)
    assert rel_err(every_step, q_form) < 3e-2  # fp16 vs bf16 m x m matrices, 6 steps


PATHS = {"kernel": KERNEL, "kernel-gram": KERNEL_GRAM, "half": HALF, "torch-gram": TORCH_GRAM}


@pytest.mark.parametrize("path", list(PATHS))
def test_zero_input_stays_zero_on_every_path(monkeypatch, path):
    if path.startswith("kernel"):
        monkeypatch.setattr(ITERATIONS, kernel_like_gram)
    out = zeropower(torch.zeros(2, 16, 40), 5, path=PATHS[path])
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("path", [None, *PATHS])
def test_the_result_does_not_depend_on_the_inputs_scale(monkeypatch, path):
    """Muon's update is scale-invariant, at both ends: a power-of-two scale from 2^-100 to
    2^100 gives the scale-1 result bit for bit (tiny and huge inputs are first brought to
    [1, 2) exactly), other tiny scales a result as close to the polar factor as at scale 1
    (their inputs round differently; subnormal entries at 1e-36);
    a gradient at 1e-12 was once orthogonalized against a norm clamped to eps (a 70x smaller
    update) and one at 1e-30 underflowed to zero."""
    if path is not None and path.startswith("kernel"):
        monkeypatch.setattr(ITERATIONS, kernel_like_gram)
    kw = {} if path is None else {"path": PATHS[path]}
    G = gradient_like(2, 24, 64, seed=7)
    at_one = zeropower(G, 5, **kw)
    for scale in (2.0**-100, 2.0**-40, 2.0**40, 2.0**100):
        assert torch.equal(zeropower(G * scale, 5, **kw), at_one), scale
    err = rel_err(at_one, polar(G))
    for scale in (1e-12, 1e-30, 1e-36):
        assert rel_err(zeropower(G * scale, 5, **kw), polar(G)) < 1.25 * err + 0.01, scale


def test_gram_iteration_on_cuda_for_wide_shapes(monkeypatch):
    import types

    import muon_plugin.orthogonalize as ortho

    def batch(*shape, cuda=True):
        return types.SimpleNamespace(shape=shape, is_cuda=cuda)

    assert ortho.use_gram_iteration(batch(1, 4096, 14336))
    assert ortho.use_gram_iteration(batch(12, 768, 3072))
    assert not ortho.use_gram_iteration(batch(1, 4096, 14336, cuda=False))  # fp16 on a CPU
    assert not ortho.use_gram_iteration(batch(48, 768, 768))  # square: plain loop is cheaper
    assert not ortho.use_gram_iteration(batch(4, 1024, 1536))  # aspect below 2
    monkeypatch.setenv("MUON_PLUGIN_DISABLE_GRAM", "1")
    assert not ortho.use_gram_iteration(batch(1, 4096, 14336))


def _low_rank_plus_noise(shape, gen) -> torch.Tensor:
    *batch, m, n = shape
    r = max(1, min(m, n) // 32)
    U = torch.randn(*batch, m, r, device="cuda", generator=gen)
    V = torch.randn(*batch, r, n, device="cuda", generator=gen)
    low = (U * torch.logspace(0, -2, r, device="cuda")) @ V
    noise = torch.randn(shape, device="cuda", generator=gen)
    return low / low.norm() + 0.01 * noise / noise.norm()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape,stack", [((768, 768), 48), ((768, 3072), 12), ((3072, 768), 12)])
def test_graphed_small_stacks_stay_as_close_to_the_polar_factor_as_the_plain_loop(shape, stack):
    """GPT-125M's stacks on their graphed path (the symmetric kernel from m = 768) are no
    farther from the exact polar factor than the plain bf16 loop, on Gaussian and on
    low-rank-plus-noise inputs (1% slack: bf16 rounding)."""
    resolved = resolve_path(shape, stack, torch.device("cuda"), torch.float32, MatrixSpec())
    path = resolved.iteration(shape[0])
    gen = torch.Generator(device="cuda").manual_seed(0)
    gauss = torch.randn(stack, *shape, device="cuda", generator=gen)
    for G in (gauss, _low_rank_plus_noise((stack, *shape), gen)):
        exact = polar(G)

        def err(X: torch.Tensor, exact=exact) -> float:
            return ((X.double() - exact).norm() / exact.norm()).item()

        fast = err(zeropower(G, path=path))
        plain = err(zeropower(G, backend="plain"))
        assert fast <= 1.01 * plain, (resolved.describe(), fast, plain)
