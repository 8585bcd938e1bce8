"""The ``"turbo_muon"`` orthogonalization: AOL row scaling from the first Gram matrix, then
Turbo-Muon's quintics, on every iteration path, in the optimizers and in the option schema.

Oracle: the same preconditioned polynomial in fp64 (:func:`float64_turbo`, written from the
definition, not from :mod:`muon_plugin.orthogonalize.aol`), and the exact polar factor (SVD).
The Triton paths run with their products emulated (``kernel_like_gram``); the kernel itself
runs them in the Triton interpreter (``tests/support/kernel_interpreter_turbo.py``), and on a GPU
inside CUDA graphs.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from subprocess_env import run_in_interpreter
from test_orthogonalize import (
    HALF,
    ITERATIONS,
    KERNEL,
    KERNEL_GRAM,
    TORCH_GRAM,
    gradient_like,
    kernel_like_gram,
    polar,
    rel_err,
)

from muon_plugin import Muon, MuonForeach
from muon_plugin.adapter import build_job_optimizers
from muon_plugin.kernels import triton_available
from muon_plugin.learning_rate import LrShapeRule
from muon_plugin.orthogonalize import (
    EPS,
    MatrixSpec,
    Schedule,
    coefficient_schedule,
    orthogonalize_stack,
    zeropower,
)
from muon_plugin.orthogonalize.aol import aol_factors, scaled_gram
from muon_plugin.orthogonalize.coefficients import TURBO_MUON_COEFFICIENTS
from muon_plugin.param_groups.builder import BaseHyperparams, optimizer_kwargs
from muon_plugin.param_groups.options import MuonConfig

DRIVERS = [Muon, MuonForeach]
PLAIN = None  # zeropower's own path on the CPU: the plain bf16 loop
PATHS = {
    "plain": PLAIN,
    "half": HALF,
    "torch-gram": TORCH_GRAM,
    "kernel": KERNEL,
    "kernel-gram": KERNEL_GRAM,
}


def float64_turbo(G: torch.Tensor, steps: int = 4, scale: float = 1.0) -> torch.Tensor:
    """The intended map in fp64: the rows of the wide orientation divided by the square roots
    of the absolute row sums of its Gram matrix, then the schedule's steps."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = X / (X @ X.mT).abs().sum(-1, keepdim=True).sqrt()
    for a, b, c in coefficient_schedule("turbo_muon", steps).coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return scale * (X.mT if tall else X)


def turbo(G: torch.Tensor, path: str, steps: int = 4, **kw) -> torch.Tensor:
    """``zeropower(G, steps, "turbo_muon")`` on one of :data:`PATHS` (Triton's emulated)."""
    chosen = PATHS[path]
    if chosen is None:
        return zeropower(G, steps, "turbo_muon", gram_space=False, **kw)
    if not path.startswith("kernel"):
        return zeropower(G, steps, "turbo_muon", path=chosen, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ITERATIONS, kernel_like_gram)
        return zeropower(G, steps, "turbo_muon", path=chosen, **kw)


def test_schedule_is_aol_with_its_fitted_quintics():
    assert coefficient_schedule("turbo_muon", 4) == Schedule(TURBO_MUON_COEFFICIENTS, 1.0, True)
    six = coefficient_schedule("turbo_muon", 6).coefficients
    assert six == (*TURBO_MUON_COEFFICIENTS, TURBO_MUON_COEFFICIENTS[-1], six[-1])
    fixed = coefficient_schedule("turbo_muon", 3, (3.4445, -4.7750, 2.0315))
    assert fixed.aol and fixed.coefficients == ((3.4445, -4.7750, 2.0315),) * 3
    assert not coefficient_schedule("polar_express", 4).aol
    assert not coefficient_schedule("newton_schulz", 4, (3.0, -3.0, 1.0)).aol


def test_aol_factors_bound_the_spectral_norm():
    """``||D X||_2 <= 1`` (the AOL bound, which replaces the norm), the factors from the
    absolute row sums of ``X X^T``; a zero row is divided by eps and stays zero."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 24, 80, generator=g, dtype=torch.float64)
    X[1] *= torch.logspace(0, -4, 24, dtype=torch.float64)[:, None]  # very uneven rows
    X[2, 5] = 0.0
    A = (X @ X.mT).float()
    f = aol_factors(A, EPS)
    assert f.shape == (3, 1, 24)
    expected = 1.0 / A.double().abs().sum(-1).sqrt().clamp_min(EPS)
    assert torch.allclose(f[:, 0].double(), expected, rtol=1e-6)
    assert f[2, 0, 5] == pytest.approx(1.0 / EPS)
    top = torch.linalg.matrix_norm(f.mT.double() * X, ord=2)
    assert (top <= 1.0 + 1e-6).all() and (top > 0.5).all(), top


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
def test_scaled_gram_is_the_fp32_scaling_rounded_once(dtype, per_row):
    """The first Gram matrix scaled by per-matrix norms or AOL's row factors goes straight into
    the loop's dtype: the same bits as scaling it in fp32 and casting after."""
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(3, 48, 160, generator=gen)
    A = X @ X.mT
    f = torch.rand(3, 1, 48 if per_row else 1, generator=gen) + 0.01
    want = (A * f.mT * (f * 7.0) if per_row else A * (f * f * 7.0)).to(dtype)
    got = scaled_gram(A.clone(), f, dtype, 7.0)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "shape,steps",
    [((48, 160), 4), ((160, 48), 4), ((3, 32, 100), 4), ((2, 64, 64), 4), ((160, 48), 1),
     ((24, 200), 2), ((300, 20), 5)],
    ids=str,
)  # fmt: skip
def test_every_path_computes_the_preconditioned_polynomial(path, shape, steps):
    """Each path is the fp64 map up to bf16 rounding: the AOL factors go into X, its fp16
    copy or the first Q (tall inputs: transposed, with the factors on the other side), and
    the Gram-space loop carries them until X is re-formed (1 and 2 steps: no restart)."""
    G = gradient_like(*shape, seed=11) * 1e3  # unnormalized, as momentum is
    out = turbo(G, path, steps, scale=1.3)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    assert rel_err(out, float64_turbo(G, steps, scale=1.3)) < 0.035


def test_the_first_gram_matrix_is_reused():
    """AOL costs no product: 4 steps form 4 Gram matrices of X and 4 squares, as 4 steps of
    the Frobenius-normalized iteration do."""
    products: list[tuple[int, ...]] = []

    def counting(X, **kw):
        products.append(tuple(X.shape))
        return kernel_like_gram(X, **kw)

    G = gradient_like(40, 96, seed=2)
    for strategy in ("polar_express", "turbo_muon"):
        for path in (KERNEL, HALF, PLAIN):
            products.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ITERATIONS, counting)
                zeropower(G, 4, strategy, path=path, gram_space=False)
            assert products.count((1, 40, 96)) == 4 and products.count((1, 40, 40)) == 4


@pytest.mark.parametrize("path", list(PATHS))
def test_zero_and_scaled_inputs(path):
    """A zero matrix stays zero; a power-of-two scale from 2^-100 to 2^100 gives the scale-1
    result bit for bit (the row factors scale exactly)."""
    out = turbo(torch.zeros(2, 16, 40), path)
    assert torch.isfinite(out).all() and (out == 0).all()
    G = gradient_like(2, 24, 64, seed=7)
    at_one = turbo(G, path)
    for scale in (2.0**-100, 2.0**-40, 2.0**40, 2.0**100):
        assert torch.equal(turbo(G * scale, path), at_one), scale


def test_four_steps_beat_polar_express_on_gaussian_inputs():
    """The measured claim (docs/design/turbo_aol.md): on Gaussian matrices 4 Turbo-Muon steps
    are closer to the exact polar factor than 5 Polar Express steps, and far closer than 4."""
    g = torch.Generator().manual_seed(1)
    for shape in ((64, 256), (8, 64, 64), (256, 896)):
        G = torch.randn(shape, generator=g)
        exact = polar(G)
        four = rel_err(zeropower(G, 4, "turbo_muon"), exact)
        assert four < 0.9 * rel_err(zeropower(G, 5), exact), shape
        assert four < 0.3 * rel_err(zeropower(G, 4), exact), shape


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_param_group_takes_turbo_muon(driver):
    """One step from zero momentum: each group's matrices move by their own strategy's
    polar factor (constructor default polar_express, one group turbo_muon x4)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(96, 32), (32, 64), (32, 64)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    start = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    groups = [
        {"params": params[:2], "orthogonalization_strategy": "turbo_muon", "ns_steps": 4},
        {"params": params[2:]},
    ]
    opt = driver(groups, lr=0.1, wd=0.0, momentum=0.0, nesterov=False)
    opt.step()
    keller = LrShapeRule("keller")  # the constructor's lr_adjust
    specs = [MatrixSpec(steps=4, strategy="turbo_muon", output_scale=keller)] * 2
    specs.append(MatrixSpec(output_scale=keller))
    for p, p0, grad, spec in zip(params, start, grads, specs, strict=True):
        expected = p0 - 0.1 * orthogonalize_stack(grad[None], spec)[0].float()
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-6)
        other = specs[2] if spec.strategy == "turbo_muon" else specs[0]
        assert rel_err(orthogonalize_stack(grad[None], other)[0], p0 - p.detach()) > 0.05
    default = driver(params, orthogonalization_strategy="turbo_muon", ns_steps=4)
    assert default.param_groups[0]["orthogonalization_strategy"] == "turbo_muon"


def test_option_schema_and_build_summary():
    """``[optimizer.muon] orthogonalization = "turbo_muon"`` reaches the constructor (every
    front end reads this schema) and the build summary; a bad value names the key."""
    cfg = MuonConfig(orthogonalization="turbo_muon", ns_steps=4)
    base = BaseHyperparams(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    kwargs = optimizer_kwargs(base, cfg)
    assert kwargs["orthogonalization_strategy"] == "turbo_muon" and kwargs["ns_steps"] == 4
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    job = build_job_optimizers([model], cfg, base)
    assert "turbo_muon x4" in job.format_build_summary()
    muon_groups = [g for g in job.optimizers[0].param_groups if g["algorithm"] == "muon"]
    assert muon_groups and all(g["orthogonalization_strategy"] == "turbo_muon" for g in muon_groups)
    with pytest.raises(ValueError, match=r"optimizer\.muon\.orthogonalization: .*'turbo_muon'"):
        MuonConfig(orthogonalization="turbo")


@pytest.mark.interpreter
def test_kernel_path_in_the_triton_interpreter():
    """The real symmetric kernel (interpreted) on the x-space and Gram-space kernel paths:
    as close to the fp64 map as the emulation, and close to the emulated result."""
    if not triton_available():
        pytest.skip("triton is not importable")
    proc = run_in_interpreter("kernel_interpreter_turbo.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6, proc.stdout
    for r in rows:
        assert r["err_fp64"] < 0.035 and r["err_emulated"] < 0.02, r


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("shape", [(96, 96), (64, 256), (256, 64), (768, 3072)], ids=str)
def test_cuda_graph_replay_equals_eager_bitwise(shape):
    """Inside a CUDA graph (the paths of GPT-sized stacks) the AOL scaling replays exactly."""
    from muon_plugin.orthogonalize import GraphedOrthogonalization, resolve_path, run_path

    spec = MatrixSpec(steps=4, strategy="turbo_muon")
    path = resolve_path(shape, 6, torch.device("cuda"), torch.float32, spec)
    assert path.graph, path.describe()
    graphed = GraphedOrthogonalization(functools.partial(run_path, path, spec=spec), "turbo")
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        X = [torch.randn(shape, device="cuda", generator=g) for _ in range(6)]
        eager = run_path(path, X, spec)
        assert torch.equal(graphed(X), eager)
        assert rel_err(eager, polar(torch.stack(X))) < 0.15
    assert graphed.captured is not None
