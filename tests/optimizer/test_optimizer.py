"""Muon / MuonForeach against torch.optim.Muon, torch.optim.AdamW and themselves."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from optimizer_support import DRIVERS, make_params, set_grads

from muon_plugin import Muon, MuonForeach
from muon_plugin.learning_rate import lr_shape_factor
from muon_plugin.orthogonalize import zeropower


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("driver", DRIVERS)
def test_matches_torch_optim_muon(driver):
    """Newton-Schulz, keller lr rule, plain decay: torch.optim.Muon's algorithm exactly."""
    shapes = [(64, 32), (32, 96), (48, 48)]
    ours = make_params(*shapes)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = driver(
        ours,
        lr=0.02,
        wd=0.1,
        orthogonalization_strategy="newton_schulz",
        lr_adjust="keller",
        use_cautious_wd=False,
    )
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    start = [p.detach().clone() for p in ours]
    for step in range(3):
        set_grads(ours, step)
        set_grads(theirs, step)
        opt.step()
        ref.step()
    for p, q, p0 in zip(ours, theirs, start, strict=True):
        # The parameters moved, and moved the same way (bf16 noise in the iteration).
        assert rel_err(p - p0, q - p0) < 3e-2
        m1 = opt.state[p]["momentum_buffer"]
        m2 = ref.state[q]["momentum_buffer"]
        torch.testing.assert_close(m1, m2, rtol=0, atol=0)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("algorithm", ["adamw", "adam"])
def test_adam_groups_match_torch(driver, fused, algorithm):
    ours = make_params((16, 8), (8,), (3, 4, 5))
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    cls = torch.optim.AdamW if algorithm == "adamw" else torch.optim.Adam
    ref = cls(theirs, **kwargs)
    opt = driver(
        [{"params": ours, "algorithm": algorithm}],
        lr=3e-3,
        adam_betas=(0.8, 0.99),
        adam_eps=1e-6,
        wd=0.05,
        fused_adam=fused,
    )
    for step in range(5):
        set_grads(ours, step)
        set_grads(theirs, step)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_foreach_matches_per_parameter():
    shapes = [(64, 32), (64, 32), (32, 96), (2, 24, 16), (24, 16)]
    a = make_params(*shapes, seed=3)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a = Muon(a, lr=0.01, lr_adjust="match_rms_adamw")
    opt_b = MuonForeach(b, lr=0.01, lr_adjust="match_rms_adamw")
    for step in range(3):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("driver", DRIVERS)
def test_single_step_is_the_muon_update(driver):
    """One step from zero momentum, written out: decay, then lr * shape factor * polar."""
    (p,) = make_params((96, 32), seed=4)
    p0 = p.detach().clone()
    set_grads([p], 0)
    grad = p.grad.clone()
    opt = driver([p], lr=0.1, wd=0.2, use_cautious_wd=False, momentum=0.9, nesterov=True)
    opt.step()
    direction = grad.lerp(0.1 * grad, 0.9)  # nesterov look-ahead of buf = 0.1 * grad
    u = zeropower(direction, 5, "polar_express").float() * lr_shape_factor(96, 32, "keller")
    expected = p0 * (1 - 0.1 * 0.2) - 0.1 * u
    assert rel_err(p.detach() - p0, expected - p0) < 1e-2


@pytest.mark.parametrize("driver", DRIVERS)
def test_cautious_weight_decay_masks_disagreeing_signs(driver):
    (p,) = make_params((32, 32), seed=5)
    p0 = p.detach().clone()
    set_grads([p], 0)
    opt = driver([p], lr=0.1, wd=0.5, lr_adjust="none", nesterov=False, momentum=0.0)
    u = zeropower(p.grad, 5).float()
    opt.step()
    agree = (u * p0) > 0
    assert 0 < agree.sum() < agree.numel()
    expected = torch.where(agree, p0 * (1 - 0.1 * 0.5), p0) - 0.1 * u
    assert rel_err(p.detach() - p0, expected - p0) < 1e-2
    # Where signs disagree, no decay at all: p moved by the update alone.
    diff = (p.detach() + 0.1 * u - p0)[~agree]
    assert diff.abs().max() < 1e-3


@pytest.mark.parametrize("driver", DRIVERS)
def test_split_sizes_equal_separate_parameters(driver):
    (fused,) = make_params((64, 32), seed=6)
    parts = [
        torch.nn.Parameter(fused.detach()[a:b].clone()) for a, b in ((0, 32), (32, 48), (48, 64))
    ]
    opt_f = driver([{"params": [fused], "split_sizes": [32, 16, 16]}], lr=0.05)
    opt_p = driver(parts, lr=0.05)
    for step in range(2):
        set_grads([fused], step)
        for part, (a, b) in zip(parts, ((0, 32), (32, 48), (48, 64)), strict=True):
            part.grad = fused.grad[a:b].clone()
        opt_f.step()
        opt_p.step()
    torch.testing.assert_close(fused.detach(), torch.cat([q.detach() for q in parts]))


@pytest.mark.parametrize("driver", DRIVERS)
def test_expert_stack_equals_separate_matrices(driver):
    (experts,) = make_params((4, 24, 40), seed=7)
    singles = [torch.nn.Parameter(experts.detach()[e].clone()) for e in range(4)]
    opt_e = driver([experts], lr=0.05)
    opt_s = driver(singles, lr=0.05)
    for step in range(2):
        set_grads([experts], step)
        for e, q in enumerate(singles):
            q.grad = experts.grad[e].clone()
        opt_e.step()
        opt_s.step()
    torch.testing.assert_close(experts.detach(), torch.stack([q.detach() for q in singles]))


@pytest.mark.parametrize("driver", DRIVERS)
def test_zero_gradient_gives_no_nan(driver):
    params = make_params((16, 8), (8,))
    opt = driver([{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}])
    for p in params:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, b in zip(params, before, strict=True):
        assert torch.isfinite(p).all()
        assert (p - b).abs().max() <= 1e-3 * b.abs().max()  # weight decay only


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_update_does_not_depend_on_the_gradients_scale(driver):
    """Two steps with gradients scaled by 2^-100 (or 2^60) move the parameters exactly as at
    scale 1 (momentum, orthogonalization and update are scale-equivariant); at 1e-30 they move
    them as far (a norm clamped to eps once made such updates 1e20 times smaller)."""
    moved = {}
    for scale in (1.0, 2.0**-100, 2.0**60, 1e-30, 1e-12):
        params = make_params((24, 16), (3, 8, 12))
        start = [p.detach().clone() for p in params]
        opt = driver(params, lr=0.02, wd=0.0)
        for step in range(2):
            set_grads(params, step)
            for p in params:
                p.grad.mul_(scale)
            opt.step()
        moved[scale] = [p.detach() - s for p, s in zip(params, start, strict=True)]
    for scale in (2.0**-100, 2.0**60):
        assert all(torch.equal(a, b) for a, b in zip(moved[scale], moved[1.0], strict=True))
    for scale in (1e-30, 1e-12):
        for a, b in zip(moved[scale], moved[1.0], strict=True):
            assert rel_err(a, b) < 0.05, scale


@pytest.mark.parametrize("driver", DRIVERS)
def test_bf16_params_keep_fp32_momentum_and_grad_untouched(driver):
    (p,) = make_params((32, 16), dtype=torch.bfloat16)
    p.grad = torch.randn(32, 16, dtype=torch.bfloat16)
    grad = p.grad.clone()
    opt = driver([p], lr=0.01)
    opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(p.grad, grad)


@pytest.mark.parametrize("driver", DRIVERS)
def test_state_dict_round_trip(driver):
    params = make_params((16, 8), (8,), seed=8)
    groups = [{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw", "lr": 1e-2}]
    opt = driver(groups, lr=0.02)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    clone_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    clone_groups = [
        {"params": clone_params[:1]},
        {"params": clone_params[1:], "algorithm": "adamw"},
    ]
    clone = driver(clone_groups, lr=0.5)
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert clone.param_groups[0]["lr"] == 0.02 and clone.param_groups[1]["lr"] == 1e-2
    set_grads(params, 2)
    set_grads(clone_params, 2)
    opt.step()
    clone.step()
    for p, q in zip(params, clone_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_closure_is_called_and_its_loss_returned():
    (p,) = make_params((8, 8))

    def closure():
        p.grad = torch.ones_like(p)
        return 1.5

    assert Muon([p]).step(closure) == 1.5


def test_named_parameters_are_accepted():
    model = torch.nn.Linear(8, 4)
    opt = MuonForeach([{"params": [model.weight]}, {"params": [model.bias], "algorithm": "adamw"}])
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    named = Muon(list(model.named_parameters())[:1])
    assert named.param_groups[0]["param_names"] == ["weight"]


def test_compile_matches_eager():
    a = make_params((32, 16), (16, 48), seed=9)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    start = [p.detach().clone() for p in a]
    opt_a = MuonForeach(a, lr=0.02)
    opt_b = MuonForeach(b, lr=0.02, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            set_grads(a, step)
            set_grads(b, step)
            opt_a.step()
            opt_b.step()
    # Compiling our step warns of nothing (Dynamo warned about tracing the schedule's cache);
    # torch's own deprecation notices from importing Inductor are not ours.
    ours = [str(w.message)[:300] for w in caught if "Dynamo" in str(w.message)]
    assert not ours, ours
    for p, q, p0 in zip(a, b, start, strict=True):
        # Inductor fuses the bf16 ops (fewer roundings): equal up to bf16 noise.
        assert rel_err(p - p0, q - p0) < 4e-2


# ------------------------------------------------------------------ bad input


def bad(match: str, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        Muon(*args, **kwargs)


def test_bad_inputs_raise_naming_the_problem():
    model = torch.nn.Linear(8, 4)
    bad("parameter 'bias'", list(model.named_parameters()))
    bad(r"shape \(4,\)", [model.bias])
    bad("complex", [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))])
    bad("unknown algorithm 'sgd'", [{"params": [model.weight], "algorithm": "sgd"}])
    bad("unknown key 'decay'", [{"params": [model.weight], "decay": 0.1}])
    bad("lr must be", [model.weight], lr=-1.0)
    bad("wd must be", [model.weight], wd=-0.1)
    bad("ns_steps=0", [model.weight], ns_steps=0)
    bad("ns_steps=2.5", [model.weight], ns_steps=2.5)
    bad("orthogonalization_strategy 'svd'", [model.weight], orthogonalization_strategy="svd")
    bad("lr_adjust 'huge'", [model.weight], lr_adjust="huge")
    bad("momentum", [model.weight], momentum=1.0)
    bad("adam_betas", [{"params": [model.bias], "algorithm": "adamw"}], adam_betas=(0.9, 1.5))
    bad("split_sizes .* sum to 3", [model.weight], split_sizes=(1, 2))
    bad("split_sizes must be positive", [model.weight], split_sizes=(4, 0))


def test_a_parameter_given_twice_is_refused_by_name():
    """torch.optim only warns, then updates such a parameter twice per step."""
    a, b = make_params((4, 4), (4, 4))
    bad(r"param group 0: parameter 'a' \(shape \(4, 4\).* appears twice \(positions 0 and 2\)",
        [("a", a), ("b", b), ("a", a)])  # fmt: skip
    opt = Muon([a])
    with pytest.raises(ValueError, match=r"param group 1: parameter #1 .* appears twice"):
        opt.add_param_group({"params": [b, b]})
    assert len(opt.param_groups) == 1


def test_a_bad_group_leaves_the_optimizer_usable():
    model = torch.nn.Linear(8, 4)
    opt = Muon([model.weight])
    with pytest.raises(ValueError, match="Muon needs matrices"):
        opt.add_param_group({"params": [model.bias]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [model.bias], "algorithm": "adamw"})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("driver", DRIVERS)
def test_bf16_params_keep_fp32_momentum_through_load_state_dict(driver):
    params = make_params((32, 16), (16,), dtype=torch.bfloat16)
    groups = [{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}]
    opt = driver(groups, lr=0.01)
    set_grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    clone_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    clone = driver(
        [{"params": clone_params[:1]}, {"params": clone_params[1:], "algorithm": "adamw"}]
    )
    clone.load_state_dict(saved)
    buf = clone.state[clone_params[0]]["momentum_buffer"]
    assert buf.dtype == torch.float32
    assert torch.equal(buf, opt.state[params[0]]["momentum_buffer"])
    assert clone.state[clone_params[1]]["step"].dtype == torch.float32


@pytest.mark.parametrize("driver", DRIVERS)
def test_phases_give_the_same_step(driver, monkeypatch):
    """A plan cut into phases (each through momentum, orthogonalization and update before the
    next) moves the parameters exactly as one pass over every matrix."""
    shapes = [(64, 64)] * 5 + [(32, 64)] * 2 + [(2, 24, 16), (24, 16)]
    a = make_params(*shapes, seed=5)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    one_pass = driver(a, lr=0.02, wd=0.1)
    for step in range(3):
        set_grads(a, step)
        one_pass.step()
    for bound in ("MAX_LOCAL_GROUP_NUMEL", "MAX_PHASE_NUMEL"):
        monkeypatch.setattr(f"muon_plugin.distributed.planner.{bound}", 2 * 64 * 64)
    phased = driver(b, lr=0.02, wd=0.1)
    for step in range(3):
        set_grads(b, step)
        phased.step()
    assert len(phased._plans.plan.phases) > 1 and len(one_pass._plans.plan.phases) == 1
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
