"""NorMuon on every path a device takes (on a GPU: the CUDA-graphed small stacks, the Triton
orthogonalization and the fused update kernel that multiplies each row by its factor): the
update equals the fp64 reference applied to plain Muon's update of the same step.

Muon and NorMuon share the momentum and the orthogonalization, so a Muon optimizer fed the same
gradients yields, at lr 1 from zero weights, exactly the orthogonalized matrices NorMuon
normalizes; the reference of ``test_normuon`` turns them into NorMuon's updates. On a CPU this
checks the CPU paths; on a GPU the paths the benchmark and a training run take.
"""

from __future__ import annotations

import pytest
import torch
from test_normuon import BETA2, EPS, MOMENTUM, assert_update_close, reference_normuon

from muon_plugin import MuonForeach
from muon_plugin.learning_rate import LrShapeRule
from muon_plugin.orthogonalize import MatrixSpec
from muon_plugin.row_state import ROW_STATE_KEY

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]  # fmt: skip

# name -> (shape, group settings, copies): several copies of a small shape make a stack that a
# GPU runs in a CUDA graph; the 256 x 1024 matrices take the Triton kernels outside graphs.
LAYOUT = {
    "square": ((96, 96), {}, 6),
    "wide": ((64, 256), {}, 3),
    "tall": ((256, 64), {}, 2),
    "big": ((256, 1024), {}, 2),
    "experts": ((4, 64, 96), {}, 1),
    "qkv": ((192, 128), {"split_sizes": (128, 32, 32)}, 1),
}


def build(device: str, normalization: str, rescale: str):
    """Zero weights in one group per layout entry, and the optimizer."""
    params, groups = {}, []
    for name, (shape, settings, copies) in LAYOUT.items():
        ps = [torch.nn.Parameter(torch.zeros(shape, device=device)) for _ in range(copies)]
        params.update({f"{name}.{i}": p for i, p in enumerate(ps)})
        groups.append({"params": ps, **settings})
    opt = MuonForeach(
        groups, lr=1.0, wd=0.0, momentum=MOMENTUM, lr_adjust="match_rms_adamw",
        normalization=normalization, normuon_beta2=BETA2, normuon_eps=EPS,
        normuon_rescale=rescale,
    )  # fmt: skip
    return params, opt


def step(params, opt, grads) -> dict[str, torch.Tensor]:
    """One step; each parameter's update (weights before minus after)."""
    before = {n: p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    opt.step()
    return {n: (before[n] - p.detach()).cpu() for n, p in params.items()}


@pytest.mark.parametrize("rescale", ["frobenius", "rms"])
@pytest.mark.parametrize("device", DEVICES)
def test_normuon_is_the_reference_applied_to_muons_update(device, rescale):
    muon_params, muon = build(device, "none", rescale)
    nor_params, normuon = build(device, "normuon", rescale)
    gen = torch.Generator(device=device).manual_seed(3)
    v = {n: None for n in nor_params}
    for t in range(3):
        # Rows of different scales, so the normalization changes the update.
        grads = {}
        for n, p in muon_params.items():
            g = torch.randn(p.shape, device=device, generator=gen)
            grads[n] = g * torch.rand(*p.shape[:-1], 1, device=device, generator=gen)
        ortho = step(muon_params, muon, grads)
        got = step(nor_params, normuon, grads)
        for n, p in nor_params.items():
            settings = LAYOUT[n.split(".")[0]][1]
            spec = MatrixSpec(output_scale=LrShapeRule("match_rms_adamw"), **settings)
            if v[n] is None:
                v[n] = torch.zeros(spec.row_shape(tuple(p.shape)), dtype=torch.float64)
            ref, v[n] = reference_normuon(ortho[n], v[n], spec, BETA2, EPS, rescale)
            assert_update_close(got[n], ref, f"{device} {n} step {t}")
            state = normuon.state[p][ROW_STATE_KEY].cpu().double()
            torch.testing.assert_close(state, v[n], rtol=1e-5, atol=0)
