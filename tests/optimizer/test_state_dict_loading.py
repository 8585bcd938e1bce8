"""Loading a state dict: matched by name (or by position), checked against each parameter,
nothing dropped silently, fp32 momentum kept (CPU, one process)."""

from __future__ import annotations

import copy

import pytest
import torch
from optimizer_support import DRIVERS, clone_params, make_params, set_grads

from muon_plugin import Muon

# ---------------------------------------------------------------------- load_state_dict


def named_groups(params, names, order):
    return [
        {"params": [params[i] for i in order], "param_names": [names[i] for i in order]},
    ]


@pytest.mark.parametrize("driver", DRIVERS)
def test_load_state_dict_matches_by_name(driver):
    """Same-shape parameters in another order receive their own momentum, not their slot's."""
    names = ["a", "b", "c"]
    params = make_params((16, 8), (16, 8), (16, 8))
    opt = driver(named_groups(params, names, [0, 1, 2]), lr=0.01)
    set_grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = clone_params(params)
    other = driver(named_groups(fresh, names, [2, 0, 1]), lr=0.01)
    other.load_state_dict(saved)
    for p, q in zip(params, fresh, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], other.state[q]["momentum_buffer"])
    # And both then step identically.
    set_grads(params, 1)
    for p, q in zip(params, fresh, strict=True):
        q.grad = p.grad.clone()
    opt.step()
    other.step()
    for p, q in zip(params, fresh, strict=True):
        assert torch.equal(p, q)


def test_load_state_dict_without_names_is_by_position():
    params = make_params((16, 8), (16, 8))
    opt = Muon(params, lr=0.01)
    set_grads(params, 0)
    opt.step()
    fresh = clone_params(params)
    other = Muon([fresh[1], fresh[0]], lr=0.01)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(
        other.state[fresh[1]]["momentum_buffer"], opt.state[params[0]]["momentum_buffer"]
    )


def test_load_state_dict_names_on_one_side_only_raise():
    params = make_params((16, 8), (16, 8))
    opt = Muon(named_groups(params, ["a", "b"], [0, 1]))
    set_grads(params, 0)
    opt.step()
    saved = opt.state_dict()
    fresh = clone_params(params)
    with pytest.raises(ValueError, match="has no parameter 'c'"):
        Muon(named_groups(fresh, ["a", "c"], [0, 1])).load_state_dict(copy.deepcopy(saved))
    renamed = copy.deepcopy(saved)
    renamed["param_groups"][0]["param_names"] = ["a", "z"]
    with pytest.raises(ValueError, match="has no parameter 'b'"):
        Muon(named_groups(fresh, ["a", "b"], [0, 1])).load_state_dict(renamed)


def test_load_state_dict_drops_no_saved_parameter_silently():
    params = make_params((16, 8), (16, 8), (16, 8))
    opt = Muon([{"params": params, "param_names": ["a", "b", "c"]}])
    set_grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["params"] = [0, 1, 2]
    fresh = clone_params(params)
    live = Muon([{"params": fresh[:2] + [fresh[2]], "param_names": ["a", "b", "d"]}])
    with pytest.raises(ValueError, match="'d'"):
        live.load_state_dict(saved)


@pytest.mark.parametrize("driver", DRIVERS)
def test_load_state_dict_checks_shapes_and_dtypes_naming_the_parameter(driver):
    params = make_params((16, 8), (8,))
    groups = [
        {"params": params[:1], "param_names": ["w"]},
        {"params": params[1:], "param_names": ["b"], "algorithm": "adamw"},
    ]
    opt = driver(groups)
    set_grads(params, 0)
    opt.step()
    saved = opt.state_dict()

    def load(mutate):
        sd = copy.deepcopy(saved)
        mutate(sd["state"])
        fresh = clone_params(params)
        other = driver(
            [
                {"params": fresh[:1], "param_names": ["w"]},
                {"params": fresh[1:], "param_names": ["b"], "algorithm": "adamw"},
            ]
        )
        other.load_state_dict(sd)

    def wrong_shape(st):
        st[0]["momentum_buffer"] = torch.zeros(8, 16)

    def wrong_dtype(st):
        st[0]["momentum_buffer"] = torch.zeros(16, 8, dtype=torch.int32)

    def wrong_adam(st):
        st[1]["exp_avg"] = torch.zeros(9)

    with pytest.raises(ValueError, match=r"parameter 'w'.*'momentum_buffer' has shape \(8, 16\)"):
        load(wrong_shape)
    with pytest.raises(ValueError, match="parameter 'w'.*'momentum_buffer' has dtype torch.int32"):
        load(wrong_dtype)
    with pytest.raises(ValueError, match=r"parameter 'b'.*'exp_avg' has shape \(9,\)"):
        load(wrong_adam)
    load(lambda st: None)  # the unchanged state loads


def test_load_state_dict_keeps_fp32_momentum_when_matching_by_name():
    params = make_params((16, 8), (16, 8), dtype=torch.bfloat16)
    opt = Muon(named_groups(params, ["a", "b"], [0, 1]))
    set_grads(params, 0)
    opt.step()
    fresh = clone_params(params)
    other = Muon(named_groups(fresh, ["a", "b"], [1, 0]))
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, fresh, strict=True):
        assert other.state[q]["momentum_buffer"].dtype == torch.float32
        assert torch.equal(other.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])


# ---------------------------------------------------------------------- deepcopy and pickle
