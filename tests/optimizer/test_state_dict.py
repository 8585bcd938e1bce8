"""Loading optimizer state (muon_plugin.state_dict): matching, checks, held-out momentum."""

from __future__ import annotations

import pytest
import torch

from muon_plugin import Muon
from muon_plugin.defaults import DEFAULTS
from muon_plugin.state_dict import (
    check_group_sizes,
    check_state_entry,
    fill_missing_settings,
    hold_out_momentum,
    match_by_name,
    place_fused_adam_steps,
    positions,
    restore_momentum,
)


def saved(*groups: tuple[list[int], list[str] | None]) -> dict:
    """A saved state dict whose groups hold these parameter ids (and names, if given)."""
    out = []
    for ids, names in groups:
        out.append({"params": ids, **({"param_names": names} if names is not None else {})})
    return {"state": {}, "param_groups": out}


def live(*names: list[str]) -> list[dict]:
    return [{"params": [torch.zeros(2, 2) for _ in ns], "param_names": ns} for ns in names]


def test_match_by_name_puts_saved_ids_in_the_live_order():
    sd = saved(([0, 1], ["a", "b"]), ([2], ["c"]))
    matched = match_by_name(sd, live(["c", "a"], ["b"]))
    assert [g["params"] for g in matched["param_groups"]] == [[2, 0], [1]]
    assert [g["param_names"] for g in matched["param_groups"]] == [["c", "a"], ["b"]]


def test_without_names_on_both_sides_state_is_matched_by_position():
    sd = saved(([0, 1], None))
    assert match_by_name(sd, live(["a", "b"])) is sd
    sd = saved(([0, 1], ["a", "b"]))
    assert match_by_name(sd, [{"params": [torch.zeros(1), torch.zeros(1)]}]) is sd


@pytest.mark.parametrize(
    ("sd", "groups", "message"),
    [
        (saved(([0, 1], ["a"])), live(["a"]), r"group 0 has 2 parameters but 1 param_names"),
        (saved(([0], ["a"]), ([1], ["a"])), live(["a"]), r"names parameter 'a' twice"),
        (saved(([0, 1], ["a", "b"])), live(["a", "a"]), r"optimizer names parameter 'a' twice"),
        (saved(([0], ["a"])), live(["a", "b"]), r"has no parameter 'b' \(of 1 missing\)"),
        (saved(([0, 1], ["a", "b"])), live(["a"]), r"has parameter 'b' \(of 1\) that this"),
    ],
)
def test_name_mismatches_are_errors_naming_the_parameter(sd, groups, message):
    with pytest.raises(ValueError, match=message):
        match_by_name(sd, groups)


def test_group_sizes_must_agree():
    check_group_sizes([{"params": [0, 1]}], [{"params": [1, 2]}])
    with pytest.raises(ValueError, match="has 2 parameter groups, the optimizer 1"):
        check_group_sizes([{"params": []}, {"params": []}], [{"params": []}])
    with pytest.raises(ValueError, match="parameter group 0 has 1 parameters, the optimizer's 2"):
        check_group_sizes([{"params": [0]}], [{"params": [0, 1]}])


def test_state_entries_are_checked_against_their_parameter():
    p = torch.zeros(4, 3)
    g = {"params": [p], "param_names": ["w"]}
    keys = ("momentum_buffer",)
    check_state_entry(
        p, {"momentum_buffer": torch.zeros(4, 3), "step": torch.tensor(1)}, g, 0, keys
    )
    with pytest.raises(ValueError, match=r"parameter 'w' .*'exp_avg' has shape \(3, 4\)"):
        check_state_entry(p, {"exp_avg": torch.zeros(3, 4)}, g, 0, keys)
    with pytest.raises(ValueError, match=r"'momentum_buffer' has dtype torch.int64"):
        check_state_entry(p, {"momentum_buffer": torch.zeros(4, 3, dtype=torch.long)}, g, 0, keys)
    c = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"'exp_avg' has dtype torch.float32"):
        check_state_entry(c, {"exp_avg": torch.zeros(2)}, {"params": [c]}, 0, keys)
    # A momentum_buffer that is not this optimizer's momentum (MuonLP reads it when converting).
    check_state_entry(p, {"momentum_buffer": torch.zeros(1)}, g, 0, ("momentum_codes",))


def test_momentum_is_held_out_and_restored_converted():
    p, q = torch.zeros(2, 2), torch.zeros(3)
    groups = [{"params": [p, q]}]
    sd = {
        "state": {0: {"momentum_buffer": torch.ones(2, 2)}, 1: {"exp_avg": torch.ones(3)}},
        "param_groups": [{"params": [0, 1]}],
    }
    rest, held = hold_out_momentum(sd, groups, ("momentum_buffer",))
    assert rest["state"] == {0: {}, 1: sd["state"][1]}
    assert list(held) == [p] and torch.equal(held[p]["momentum_buffer"], torch.ones(2, 2))
    state: dict = {p: {}}
    restore_momentum(
        held, positions(groups), state, lambda t, m: {"momentum_buffer": 2 * m["momentum_buffer"]}
    )
    assert torch.equal(state[p]["momentum_buffer"], 2 * torch.ones(2, 2))

    def refuse(t, m):
        raise ValueError("unknown format")

    with pytest.raises(ValueError, match=r"cannot load the state of parameter #0 .*unknown format"):
        restore_momentum(held, positions(groups), state, refuse)


def test_groups_saved_before_a_setting_existed_get_its_default():
    groups = [{"params": [], "lr": 0.5}]
    fill_missing_settings(groups, {**DEFAULTS, "lr": 0.1, "ns_steps": 7})
    assert groups[0]["lr"] == 0.5 and groups[0]["ns_steps"] == 7 and groups[0]["flatten"] is False


def test_fused_adam_steps_are_fp32_on_the_parameter_device():
    p, m = torch.zeros(2), torch.zeros(2, 2)
    state = {p: {"step": torch.tensor(3, dtype=torch.float64)}, m: {"step": torch.tensor(3)}}
    groups = [
        {"params": [p], "algorithm": "adamw", "fused_adam": True},
        {"params": [m], "algorithm": "muon", "fused_adam": True},
    ]
    place_fused_adam_steps(groups, state)
    assert state[p]["step"].dtype == torch.float32 and state[m]["step"].dtype == torch.int64


def test_an_old_checkpoint_without_a_setting_loads_with_the_default():
    w = torch.nn.Parameter(torch.randn(8, 4))
    opt = Muon([w], lr=0.01, ns_steps=3)
    w.grad = torch.randn(8, 4)
    opt.step()
    sd = opt.state_dict()
    del sd["param_groups"][0]["ns_steps"]
    fresh = Muon([w], lr=0.01, ns_steps=3)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["ns_steps"] == 3
    assert torch.equal(fresh.state[w]["momentum_buffer"], opt.state[w]["momentum_buffer"])


def test_a_parameter_without_saved_state_is_named_in_a_warning():
    """A state dict that has state for some parameters but not for another restarts that
    one's momentum: said, naming it; a state dict saved before any step says nothing."""
    a, b = (torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2))
    opt = Muon([{"params": [a, b], "param_names": ["a", "b"]}], lr=0.02)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    del sd["state"][1]  # b's
    fresh = Muon([{"params": [a, b], "param_names": ["a", "b"]}], lr=0.02)
    with pytest.warns(UserWarning, match=r"no state for parameter 'b' \(shape \(6, 4\)"):
        fresh.load_state_dict(sd)
    import warnings

    unstepped = Muon([{"params": [a, b], "param_names": ["a", "b"]}], lr=0.02).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([{"params": [a, b], "param_names": ["a", "b"]}], lr=0.02).load_state_dict(unstepped)
