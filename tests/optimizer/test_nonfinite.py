"""Non-finite and huge values: skip_nonfinite keeps a bad matrix's weights and momentum, one
non-finite entry poisons only its own result, huge gradients are orthogonalized like any
other (CPU, one process)."""

from __future__ import annotations

import math

import pytest
import torch
from optimizer_support import DRIVERS, clone_params, lp_driver, make_params, set_grads

from muon_plugin import Muon, MuonForeach
from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack, zeropower


def nonfinite_grads(params, step, bad: dict[int, float]):
    set_grads(params, step)
    for k, value in bad.items():
        params[k].grad[1, 2] = value


SKIP_CASES = [(d, v) for d in DRIVERS for v in (math.nan, math.inf, -math.inf)] + [
    ("MuonLP-int8", math.nan),
    ("MuonLP-bf16", math.inf),
]


@pytest.mark.parametrize("phased", [False, True], ids=["one pass", "one phase per matrix"])
@pytest.mark.parametrize(("driver", "value"), SKIP_CASES)
def test_skip_nonfinite_keeps_weights_and_momentum_of_the_bad_matrix(
    driver, value, phased, monkeypatch
):
    if phased:  # each matrix a phase of its own (momentum -> update, one after another)
        for bound in ("MAX_LOCAL_GROUP_NUMEL", "MAX_PHASE_NUMEL"):
            monkeypatch.setattr(f"muon_plugin.distributed.planner.{bound}", 64 * 64)
    if driver == "MuonLP-int8":
        driver = lp_driver(state_dtype="int8", block_size=64)
    elif driver == "MuonLP-bf16":
        driver = lp_driver(state_dtype="bf16")
    params = make_params((64, 64), (64, 64), (16, 32))
    twin = clone_params(params)
    opt = driver(params, lr=0.02, skip_nonfinite=True)
    ref = driver(twin[:1] + twin[2:], lr=0.02)  # the same optimizer without the bad matrix
    set_grads(params, 0)
    for p, q in zip(params, twin, strict=True):
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    twin[1].data.copy_(params[1])
    before = params[1].detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[params[1]].items()}
    nonfinite_grads(params, 1, {1: value})
    for p, q in zip(params, twin, strict=True):
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert opt.skipped_updates == 1
    assert torch.equal(params[1], before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[params[1]][k], v), k
    for k in (0, 2):
        assert torch.equal(params[k], twin[k])
    # Training goes on: a finite gradient updates it again.
    set_grads(params, 2)
    opt.step()
    assert torch.isfinite(params[1]).all() and not torch.equal(params[1], before)
    assert opt.skipped_updates == 1


def test_without_skip_nonfinite_a_nan_poisons_the_matrix():
    params = make_params((16, 8))
    opt = Muon(params, lr=0.02)
    nonfinite_grads(params, 0, {0: math.nan})
    opt.step()
    assert not torch.isfinite(params[0]).any() and opt.skipped_updates == 0


def test_skip_nonfinite_first_step_keeps_zero_momentum():
    params = make_params((16, 8))
    opt = MuonForeach(params, lr=0.02, skip_nonfinite=True)
    before = params[0].detach().clone()
    nonfinite_grads(params, 0, {0: math.nan})
    opt.step()
    assert torch.equal(params[0], before)
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], torch.zeros(16, 8))


def test_skip_nonfinite_skips_only_the_bad_row_block_or_batch_matrix():
    """Split row blocks and batched matrices are orthogonalized one by one: only the bad one
    is skipped (the elementwise mask is exactly the non-finite matrices)."""
    fused = make_params((24, 16))
    experts = make_params((3, 16, 8))
    opt = MuonForeach(
        [{"params": fused, "split_sizes": (8, 8, 8)}, {"params": experts}],
        lr=0.02,
        skip_nonfinite=True,
    )
    f0, e0 = fused[0].detach().clone(), experts[0].detach().clone()
    set_grads(fused + experts, 0)
    fused[0].grad[9, 0] = math.nan  # row block 1
    experts[0].grad[2, 3, 1] = math.inf  # matrix 2
    opt.step()
    assert opt.skipped_updates == 2
    assert torch.equal(fused[0][8:16], f0[8:16]) and torch.equal(experts[0][2], e0[2])
    assert not torch.equal(fused[0][:8], f0[:8]) and not torch.equal(experts[0][0], e0[0])
    assert torch.isfinite(fused[0]).all() and torch.isfinite(experts[0]).all()
    buf = opt.state[fused[0]]["momentum_buffer"]
    assert torch.equal(buf[8:16], torch.zeros(8, 16)) and buf[:8].abs().sum() > 0


@pytest.mark.parametrize("gram_space", [False, True])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 3e38])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
def test_one_nonfinite_entry_makes_the_whole_result_nonfinite(gram_space, value, shape):
    """What skip_nonfinite relies on, for the plain and the Gram-space iteration: one NaN/Inf
    makes every entry of the result non-finite (a huge finite entry does not)."""
    G = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    G[0, 3, 5] = value
    out = zeropower(G, 5, "polar_express", gram_space=gram_space).float()
    if math.isfinite(value):
        assert torch.isfinite(out).all()
    else:
        assert not torch.isfinite(out[0]).any()
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("strategy", ["polar_express", "newton_schulz"])
@pytest.mark.parametrize("scale", [1e19, 1e30, 2.0**126])
def test_huge_gradients_are_orthogonalized_like_any_other(strategy, scale):
    """Entries above ~1.8e19 overflowed the fp32 norm: the update was exactly zero. Now the
    result is that of the same matrix scaled down by a power of two (exact), bit for bit."""
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    G[0, 0] = 3.0
    big = (G * scale).to(torch.bfloat16)
    small = big * 2.0 ** -math.floor(math.log2(scale))  # exact: the same bf16 mantissas
    for gram_space in (False, True):
        ref = zeropower(small, 5, strategy, gram_space=gram_space)
        out = zeropower(big, 5, strategy, gram_space=gram_space)
        assert ref.float().abs().sum() > 0
        assert torch.equal(out, ref)
    spec = MatrixSpec(strategy=strategy)
    assert torch.equal(orthogonalize_stack(big[None], spec), orthogonalize_stack(small[None], spec))


def test_ordinary_inputs_are_not_rescaled():
    """The overflow guard is exactly the identity for ordinary inputs."""
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 1e6
    from muon_plugin.orthogonalize import Normalization

    X = G.to(torch.bfloat16)
    Y = X.clone()
    Normalization(1.01).prescale_(Y[None])
    assert torch.equal(X, Y)
