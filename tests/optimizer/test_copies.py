"""Copies of an optimizer (deepcopy, pickle, torch.save) keep its configuration and step like
the original (CPU, one process)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from optimizer_support import lp_driver, make_params, set_grads

from muon_plugin import Muon, MuonForeach


def round_trips():
    def deep(opt):
        return copy.deepcopy(opt)

    def pickled(opt):
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def plain_pickle(opt):
        return pickle.loads(pickle.dumps(opt))

    return [deep, pickled, plain_pickle]


COPY_CASES = [
    (kind, i)
    for kind in ("Muon", "MuonForeach", "MuonLP-int8", "MuonLP-int4")
    for i in range(3)
    if not (kind.startswith("MuonLP") and i == 2)  # plain pickle: once per non-LP kind
]


@pytest.mark.parametrize(("kind", "trip"), COPY_CASES)
def test_copies_step_like_the_original(kind, trip):
    round_trip = round_trips()[trip]
    if kind == "Muon":
        driver = Muon
    elif kind == "MuonForeach":
        driver = MuonForeach
    elif kind == "MuonLP-int8":
        driver = lp_driver(state_dtype="int8", block_size=64)
    else:
        driver = lp_driver(state_dtype="int4")
    params = make_params((64, 64), (16, 32), (64,))
    groups = [
        {"params": params[:2], "param_names": ["w1", "w2"]},
        {"params": params[2:], "param_names": ["b"], "algorithm": "adamw"},
    ]
    opt = driver(groups, lr=0.02, skip_nonfinite=True)
    set_grads(params, 0)
    opt.step()
    twin = round_trip(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert twin.skip_nonfinite and twin.skipped_updates == 0
    for name in ("state_dtype", "block_size"):
        if hasattr(opt, name):
            assert getattr(twin, name) == getattr(opt, name)
    for step in (1, 2):
        set_grads(params, step)
        for p, q in zip(params, twin_params, strict=True):
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params, strict=True):
        assert q is not p
        assert torch.equal(p, q)


def test_deepcopy_keeps_the_replicate_group_and_pickle_drops_it():
    def marker():  # stands in for a process group: neither picklable nor copyable here
        return None

    params = make_params((16, 8))
    opt = Muon(params)
    opt.replicate_group = marker
    assert copy.deepcopy(opt).replicate_group is marker
    twin = pickle.loads(pickle.dumps(opt))
    assert twin.replicate_group is None and opt.replicate_group is marker


# ---------------------------------------------------------------------- Tensor lr
