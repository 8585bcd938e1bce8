"""torch.optim's conventions the optimizer follows: a Tensor lr, torch.optim.Muon's argument
names as synonyms (giving its numbers), validated coefficients, complex AdamW parameters."""

from __future__ import annotations

import pytest
import torch
from optimizer_support import DRIVERS, clone_params, make_params, set_grads

from muon_plugin import Muon


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_one_element_tensor_lr_works_like_a_float(driver, shape):
    params = make_params((32, 16), (16,))
    twin = clone_params(params)

    def groups(ps):
        return [{"params": ps[:1]}, {"params": ps[1:], "algorithm": "adamw"}]

    a = driver(groups(params), lr=0.01)
    b = driver(groups(twin), lr=torch.full(shape, 0.01))
    for step in range(2):
        set_grads(params, step)
        set_grads(twin, step)
        a.step()
        b.step()
    for p, q in zip(params, twin, strict=True):
        assert torch.equal(p, q)


def test_two_element_tensor_lr_raises_value_error_naming_lr():
    with pytest.raises(ValueError, match=r"Tensor lr must be 1-element.*shape \(2,\)"):
        Muon(make_params((8, 4)), lr=torch.tensor([0.01, 0.02]))


# ---------------------------------------------------------------------- torch.optim names


def test_torch_names_are_synonyms_of_ours():
    params = make_params((8, 4))
    opt = Muon(params, weight_decay=0.2, adjust_lr_fn="match_rms_adamw", eps=1e-6)
    g = opt.param_groups[0]
    assert (g["wd"], g["lr_adjust"], g["ns_eps"]) == (0.2, "match_rms_adamw", 1e-6)
    assert "weight_decay" not in g and "adjust_lr_fn" not in g and "eps" not in g
    assert Muon(params, adjust_lr_fn="original").param_groups[0]["lr_adjust"] == "keller"
    assert Muon(params, adjust_lr_fn=None).param_groups[0]["lr_adjust"] == "keller"
    bias = make_params((4,))
    opt = Muon(
        [
            {"params": params, "weight_decay": 0.3, "adjust_lr_fn": "original", "eps": 1e-5},
            {"params": bias, "algorithm": "adamw", "eps": 1e-6, "betas": (0.8, 0.9)},
        ]
    )
    muon, adam = opt.param_groups
    assert (muon["wd"], muon["lr_adjust"], muon["ns_eps"]) == (0.3, "keller", 1e-5)
    assert (adam["adam_eps"], adam["adam_betas"]) == (1e-6, (0.8, 0.9))


def test_both_names_of_one_setting_raise_naming_both():
    params = make_params((8, 4))
    with pytest.raises(ValueError, match="both 'weight_decay' and 'wd'"):
        Muon(params, wd=0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="both 'adjust_lr_fn' and 'lr_adjust'"):
        Muon(params, lr_adjust="keller", adjust_lr_fn="original")
    with pytest.raises(ValueError, match="both 'eps' and 'ns_eps'"):
        Muon(params, ns_eps=1e-7, eps=1e-7)
    with pytest.raises(ValueError, match="param group 0: both 'weight_decay' and 'wd'"):
        Muon([{"params": params, "wd": 0.1, "weight_decay": 0.2}])
    with pytest.raises(ValueError, match="param group 0: both 'eps' and 'adam_eps'"):
        Muon([{"params": make_params((4,)), "algorithm": "adamw", "eps": 1e-6, "adam_eps": 1e-8}])
    with pytest.raises(ValueError, match="Adjust learning rate function arbitrary"):
        Muon(params, adjust_lr_fn="arbitrary")


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_torch_arguments_give_torch_optim_muon_numbers(driver, adjust):
    """torch.optim.Muon's arguments, ours plain decay: its update up to bf16 noise, exactly
    the same momentum; and the same numbers as our own names for the same settings."""
    shapes = [(64, 32), (32, 96)]
    ours = make_params(*shapes)
    theirs = clone_params(ours)
    mine = clone_params(ours)
    kwargs = dict(
        lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust, eps=1e-7, ns_coefficients=(3.4, -4.7, 2.0)
    )
    opt = driver(ours, use_cautious_wd=False, ns_steps=5, **kwargs)
    ref = torch.optim.Muon(theirs, ns_steps=5, **kwargs)
    same = driver(
        mine,
        lr=0.02,
        wd=0.1,
        lr_adjust="keller" if adjust == "original" else adjust,
        ns_eps=1e-7,
        ns_coefficients=(3.4, -4.7, 2.0),
        use_cautious_wd=False,
    )
    start = [p.detach().clone() for p in ours]
    for step in range(3):
        for ps in (ours, theirs, mine):
            set_grads(ps, step)
        opt.step()
        ref.step()
        same.step()
    for p, q, r, p0 in zip(ours, theirs, mine, start, strict=True):
        rel = ((p - q).double().norm() / (q - p0).double().norm()).item()
        assert rel < 3e-2
        assert torch.equal(p, r)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"], rtol=0, atol=0
        )


def test_ns_coefficients_are_validated():
    with pytest.raises(ValueError, match="ns_coefficients must be three finite numbers"):
        Muon(make_params((8, 4)), ns_coefficients=(1.0, 2.0))


# ---------------------------------------------------------------------- complex AdamW


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("driver", DRIVERS)
def test_complex_adamw_params_update_like_torch_adamw(driver, fused):
    g = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.complex64, generator=g))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt = driver(
        [{"params": [ours], "algorithm": "adamw"}],
        lr=0.01,
        wd=0.1,
        adam_betas=(0.9, 0.95),
        adam_eps=1e-8,
        fused_adam=fused,
    )
    ref = torch.optim.AdamW(
        [theirs], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=not fused
    )
    for _ in range(3):
        grad = torch.randn(6, 5, dtype=torch.complex64, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert ours.dtype == torch.complex64 and opt.state[ours]["exp_avg"].is_complex()


# ---------------------------------------------------------------------- non-finite updates
