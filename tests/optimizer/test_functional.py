"""The functional core (muon_plugin.functional): each stage against hand-written math, and the
entry point against the stages and the optimizer classes that drive it."""

from __future__ import annotations

import pytest
import torch

from muon_plugin import Muon, MuonForeach
from muon_plugin import functional as F
from muon_plugin.distributed.plan import plan_orthogonalization
from muon_plugin.functional import GroupSettings
from muon_plugin.learning_rate import LrShapeRule, lr_shape_factor
from muon_plugin.orthogonalize import MatrixSpec, zeropower

SHAPES = [(8, 6), (5, 7), (3, 4, 6)]


def tensors(shapes, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def as_lists_of_one(fn, *lists, **kwargs):
    """``fn`` called on one entry of each list at a time (the per-parameter path)."""
    out = []
    for items in zip(*lists, strict=True):
        result = fn(*[[x] for x in items], **kwargs)
        out += result if result is not None else []
    return out


class Doubling:
    """A plan stand-in: each update is twice its direction; remembers what it was given."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def run(self, directions):
        self.seen = [d.clone() for d in directions]
        return [2.0 * d for d in directions]


# ---------------------------------------------------------------------- stage 1: momentum


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_momentum_matches_the_formulas(nesterov, foreach):
    m = 0.9
    grads, bufs = tensors(SHAPES, 0), tensors(SHAPES, 1)
    expected_bufs = [m * b + (1 - m) * g for g, b in zip(grads, bufs, strict=True)]
    if nesterov:
        expected = [g + m * (b - g) for g, b in zip(grads, expected_bufs, strict=True)]
    else:
        expected = expected_bufs
    if foreach:
        directions = F.momentum_update_(grads, bufs, m, nesterov)
    else:
        directions = as_lists_of_one(F.momentum_update_, grads, bufs, momentum=m, nesterov=nesterov)
    for d, e, b, eb in zip(directions, expected, bufs, expected_bufs, strict=True):
        torch.testing.assert_close(b, eb, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(d, e, rtol=1e-13, atol=1e-15)
    if not nesterov:  # the direction is the buffer itself
        assert all(d is b for d, b in zip(directions, bufs, strict=True))


def test_momentum_of_bf16_gradients_runs_in_the_fp32_buffers():
    grads = [g.to(torch.bfloat16) for g in tensors(SHAPES, 2)]
    bufs = tensors(SHAPES, 3, torch.float32)
    start = [b.clone() for b in bufs]
    directions = F.momentum_update_(grads, bufs, 0.95, True)
    for g, b, b0, d in zip(grads, bufs, start, directions, strict=True):
        assert b.dtype == d.dtype == torch.float32 and g.dtype == torch.bfloat16
        torch.testing.assert_close(b, b0.lerp(g.float(), 0.05), rtol=0, atol=0)


def test_momentum_foreach_and_lists_of_one_agree_bitwise():
    grads = tensors(SHAPES, 4, torch.float32)
    a, b = tensors(SHAPES, 5, torch.float32), tensors(SHAPES, 5, torch.float32)
    da = F.momentum_update_(grads, a, 0.9, True)
    db = as_lists_of_one(F.momentum_update_, grads, b, momentum=0.9, nesterov=True)
    for x, y in zip(da + a, db + b, strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------- stage 2: orthogonalize


def test_orthogonalize_hands_the_directions_to_the_plan_in_order():
    plan = Doubling()
    directions = tensors(SHAPES, 6)
    updates = F.orthogonalize(directions, plan)
    assert all(torch.equal(s, d) for s, d in zip(plan.seen, directions, strict=True))
    assert all(torch.equal(u, 2 * d) for u, d in zip(updates, directions, strict=True))


@pytest.mark.parametrize("batched", [True, False])
def test_orthogonalize_with_a_real_plan_is_the_scaled_polar_factor(batched):
    directions = tensors([(32, 16), (16, 48), (32, 16)], 7, torch.float32)
    spec = MatrixSpec(steps=5, strategy="polar_express", output_scale=LrShapeRule("keller"))
    plan = plan_orthogonalization(directions, [spec] * 3, batched=batched)
    updates = F.orthogonalize(directions, plan)
    for d, u in zip(directions, updates, strict=True):
        expected = zeropower(d, 5, "polar_express").float() * lr_shape_factor(*d.shape, "keller")
        torch.testing.assert_close(u.float(), expected, rtol=0, atol=1e-2)


# ---------------------------------------------------------------------- stage 3: update


@pytest.mark.parametrize("cautious", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_decay_and_update_matches_the_formulas(cautious, foreach):
    lr, wd = 0.1, 0.3
    params, updates = tensors(SHAPES, 8), tensors(SHAPES, 9)
    expected = []
    for p, u in zip(params, updates, strict=True):
        decay = lr * wd * p
        if cautious:  # only where update and parameter agree in sign
            decay = torch.where(u * p > 0, decay, torch.zeros_like(p))
        expected.append(p - decay - lr * u)
    if foreach:
        F.decay_and_update_(params, updates, lr, wd, cautious)
    else:
        as_lists_of_one(
            F.decay_and_update_, params, updates, lr=lr, weight_decay=wd, cautious=cautious
        )
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p, e, rtol=1e-13, atol=1e-15)


def test_cautious_mask_is_exactly_the_sign_agreement():
    p0 = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.0, 3.0]], dtype=torch.float64)
    u = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 0.0]], dtype=torch.float64)
    p = p0.clone()
    F.decay_and_update_([p], [u], 1.0, 0.5, True)
    agree = torch.tensor([[True, False, False, True, False, False]])  # u * p > 0 (0 never)
    torch.testing.assert_close(p, torch.where(agree, 0.5 * p0, p0) - u, rtol=0, atol=0)


def test_tensor_lr_and_zero_weight_decay():
    params, updates = tensors(SHAPES, 10), tensors(SHAPES, 11)
    expected = [p - 0.05 * u for p, u in zip(params, updates, strict=True)]
    F.decay_and_update_(params, updates, torch.tensor(0.05, dtype=torch.float64), 0.0, True)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p, e, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------- the entry point


def settings(size, **kw):
    base = dict(lr=0.05, weight_decay=0.2, momentum=0.9, nesterov=True, cautious=True)
    return GroupSettings(size=size, **{**base, **kw})


def test_group_chunks_cover_each_group_at_once_or_one_by_one():
    groups = [settings(2), settings(0), settings(3)]
    whole = [(g.size, list(r)) for g, r in F.group_chunks(groups, foreach=True)]
    assert whole == [(2, [0, 1]), (0, []), (3, [2, 3, 4])]
    single = [list(r) for _, r in F.group_chunks(groups, foreach=False)]
    assert single == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize("foreach", [True, False])
def test_muon_runs_the_three_stages_group_by_group(foreach):
    shapes = [(8, 6), (5, 7), (6, 6)]
    groups = [settings(2), settings(1, lr=0.01, weight_decay=0.0, momentum=0.5, nesterov=False)]
    params, grads, bufs = tensors(shapes, 12), tensors(shapes, 13), tensors(shapes, 14)
    ref_params, ref_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    skipped = F.muon(params, grads, bufs, groups, Doubling(), foreach=foreach)
    assert skipped == []
    start = 0
    for g in groups:
        idx = range(start, start + g.size)
        ds = F.momentum_update_(
            [grads[i] for i in idx], [ref_bufs[i] for i in idx], g.momentum, g.nesterov
        )
        us = [2.0 * d for d in ds]
        F.decay_and_update_([ref_params[i] for i in idx], us, g.lr, g.weight_decay, g.cautious)
        start += g.size
    for a, b in zip(params + bufs, ref_params + ref_bufs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("foreach", [True, False])
def test_muon_skips_a_nonfinite_update_keeping_weights_and_momentum(foreach):
    shapes = [(8, 6), (5, 7)]
    params, grads, bufs = tensors(shapes, 15), tensors(shapes, 16), tensors(shapes, 17)
    grads[1][2, 3] = float("nan")
    before_p, before_b = [p.clone() for p in params], [b.clone() for b in bufs]

    class Spreading(Doubling):  # a NaN anywhere makes the whole update NaN, as Newton-Schulz
        def run(self, directions):
            return [d * float("nan") if not d.isfinite().all() else 2 * d for d in directions]

    skipped = F.muon(
        params, grads, bufs, [settings(2)], Spreading(), foreach=foreach, skip_nonfinite=True
    )
    assert skipped == [1]
    assert torch.equal(params[1], before_p[1]) and torch.equal(bufs[1], before_b[1])
    assert not torch.equal(params[0], before_p[0]) and not torch.equal(bufs[0], before_b[0])


def test_nonfinite_updates_give_positions_and_masks():
    updates = [torch.ones(2, 2), torch.tensor([[1.0, float("inf")], [2.0, 3.0]])]
    found = F.nonfinite_updates(updates)
    assert list(found) == [1]
    assert torch.equal(found[1], torch.tensor([[True, False], [True, True]]))
    assert F.nonfinite_updates([]) == {}


@pytest.mark.parametrize("driver", [Muon, MuonForeach])
def test_the_optimizer_classes_drive_the_entry_point(driver):
    """Two steps of the optimizer equal two calls of ``functional.muon`` on the same lists."""
    shapes = [(16, 8), (8, 24), (2, 8, 8)]
    params = [torch.nn.Parameter(t) for t in tensors(shapes, 18, torch.float32)]
    mine = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in mine]
    opt = driver(params, lr=0.02, wd=0.1, momentum=0.9)
    spec = MatrixSpec(steps=5, strategy="polar_express", output_scale=LrShapeRule("keller"))
    plan = plan_orthogonalization(mine, [spec] * len(mine), batched=driver.batched)
    for step in range(2):
        grads = tensors(shapes, 19 + step, torch.float32)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        group = settings(len(mine), lr=0.02, weight_decay=0.1, momentum=0.9)
        F.muon(mine, grads, bufs, [group], plan, foreach=driver.batched)
    for p, q, b in zip(params, mine, bufs, strict=True):
        assert torch.equal(p.detach(), q)
        assert torch.equal(opt.state[p]["momentum_buffer"], b)


def test_momentum_dtype():
    assert F.momentum_dtype(torch.bfloat16) == F.momentum_dtype(torch.float16) == torch.float32
    assert F.momentum_dtype(torch.float64) == torch.float64
