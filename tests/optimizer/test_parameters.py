"""How the optimizer names parameters (muon_plugin.parameters): one naming for every message."""

from __future__ import annotations

import torch

from muon_plugin.parameters import describe, local, names_by_id, param_name


def test_names_are_fqns_when_given_else_positions():
    a, b, c = torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)
    named = {"params": [a, b], "param_names": ["w", "v"]}
    plain = {"params": [c]}
    assert param_name(named, 1) == "v" and param_name(plain, 0) == "#0"
    assert param_name(plain, 0, group_index=2) == "group 2 #0"
    assert describe(named, 0, a) == "parameter 'w' (shape (2, 3), dtype torch.float32)"
    assert describe(plain, 0, c) == "parameter #0 (shape (1,), dtype torch.float32)"
    assert names_by_id([named, plain]) == {id(a): "w", id(b): "v", id(c): "group 1 #0"}


def test_local_of_a_plain_tensor_is_the_tensor():
    t = torch.zeros(2)
    assert local(t) is t
