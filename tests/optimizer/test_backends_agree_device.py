"""Every built-in backend's update equals the plain backend's, step after step, through the
optimizer's whole step, on the matrix shapes of the models the benchmarks train.

On a GPU this is where the paths differ: stacks replayed from CUDA graphs (on side streams, in
phases), the Triton symmetric kernel in its graphed region (m >= 768), Gram space with its
fp16 products, TMA loads, the fused update kernel. Each backend gets the same gradients
(``scripts/update_spectrum.py``'s stress inputs: Gaussian, rank one plus noise, decaying
spectrum, one dominant singular value, tiny), at lr 1 from zero weights, so each step's
update is the orthogonalized momentum itself; it must stay
finite, keep its largest singular value near 1 and match the plain bf16 loop's within the
iteration's own rounding. On a CPU the same runs at a reduced size (the CPU paths).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from muon_plugin import MuonForeach

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from update_spectrum import stress_input  # noqa: E402  (the stress inputs of its GPU check)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (count, shape) of each model's Muon matrices: the convergence benchmark's 88M llama3 and
# GPT-125M (the step benchmark's small model).
MODELS = {
    "llama88m": ((48, (768, 768)), (24, (2048, 768)), (12, (768, 2048))),
    "gpt125m": ((48, (768, 768)), (12, (3072, 768)), (12, (768, 3072))),
}
BACKENDS = (
    "auto",
    "eager",
    "auto:no-gram",
    "auto:no-triton",
    "auto:no-half",
    "auto:no-tma",
    "cublas",
)
INPUTS = ("gauss", "rank1+noise", "decay2", "spike", "tiny", "gauss", "rank1+noise", "decay2")
STEPS = len(INPUTS) if CUDA else 3
DIV = 1 if CUDA else 16  # every dimension divided by this on a CPU
# Relative Frobenius distance to the plain loop's update: the bf16 loop and the fp16 / kernel
# forms each round differently (about 1e-2 on Gaussian inputs; more where small singular
# values are far from converged, as with rank one plus noise).
TOLERANCE = 0.1
SIGMA_MAX = 1.25  # Polar Express ends at most about 1.13 above its smallest singular values


def shapes(model: str) -> list[tuple[int, tuple[int, int]]]:
    """``model``'s ``(count, shape)`` at this device's size."""
    return [(count, (m // DIV, n // DIV)) for count, (m, n) in MODELS[model]]


@functools.cache
def gradients(model: str) -> list[list[torch.Tensor]]:
    """Per step, per shape, the ``(count, m, n)`` gradients every backend is given."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    sized = shapes(model)
    return [[stress_input(kind, c, m, n, gen) for c, (m, n) in sized] for kind in INPUTS[:STEPS]]


def updates(backend: str, model: str) -> list[list[torch.Tensor]]:
    """Per step, per shape, the stacked updates (fp32, on the device) of ``backend``."""
    params = [
        [torch.nn.Parameter(torch.zeros(shape, device=DEVICE)) for _ in range(count)]
        for count, shape in shapes(model)
    ]
    opt = MuonForeach(
        [p for group in params for p in group],
        lr=1.0, momentum=0.95, wd=0.0, lr_adjust="none", backend=backend,
    )  # fmt: skip
    out = []
    for step_grads in gradients(model):
        for group, grads in zip(params, step_grads, strict=True):
            for p, g in zip(group, grads, strict=True):
                p.grad = g
        before = [torch.stack([p.detach() for p in group]).clone() for group in params]
        opt.step()
        out.append(
            [(b - torch.stack([p.detach() for p in group])).float()
             for b, group in zip(before, params, strict=True)]
        )  # fmt: skip
    return out


def largest_singular_value(u: torch.Tensor) -> float:
    """The largest singular value over the stack ``u``: the root of the top eigenvalue of the
    smaller Gram matrix (a batched symmetric eigensolve, much faster on a GPU than an SVD).
    Exact, as a bound's check needs; ``update_spectrum``'s power iteration is an estimate from
    below, enough to see an update grow."""
    gram = u @ u.mT if u.shape[-2] <= u.shape[-1] else u.mT @ u
    return torch.linalg.eigvalsh(gram.double())[..., -1].max().clamp_min(0).sqrt().item()


@functools.cache
def reference(model: str) -> list[list[torch.Tensor]]:
    """The plain loop's updates: every backend's reference (made once per model)."""
    return updates("plain", model)


@pytest.mark.parametrize("model", list(MODELS) if CUDA else ["llama88m"])
@pytest.mark.parametrize("backend", BACKENDS if CUDA else ("auto", "auto:no-gram"))
def test_backend_update_equals_plain(backend, model):
    got = updates(backend, model)
    for step, (kind, ours, ref) in enumerate(zip(INPUTS, got, reference(model), strict=False)):
        for (_, shape), u, r in zip(MODELS[model], ours, ref, strict=True):
            where = f"{backend}, {model} {shape}, step {step} ({kind})"
            assert torch.isfinite(u).all(), f"{where}: non-finite update"
            sigma = largest_singular_value(u)
            assert sigma < SIGMA_MAX, f"{where}: largest singular value {sigma:.3f}"
            err = ((u - r).norm() / r.norm()).item()
            assert err < TOLERANCE, f"{where}: {err:.4f} from the plain loop's update"
