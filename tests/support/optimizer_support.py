"""Parameters, gradients and drivers shared by the optimizer tests."""

from __future__ import annotations

import pytest
import torch

from muon_plugin import Muon, MuonForeach

DRIVERS = [Muon, MuonForeach]


def make_params(*shapes, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype) * 0.02) for s in shapes]


def set_grads(params, step: int, seed: int = 100):
    g = torch.Generator().manual_seed(seed + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def lp_or_skip():
    pytest.importorskip("torchao")
    from muon_plugin.lp import MuonLP

    return MuonLP


def lp_driver(**kwargs):
    """A MuonLP constructor with ``kwargs`` fixed (skips without torchao)."""
    MuonLP = lp_or_skip()

    def build(groups, **kw):
        return MuonLP(groups, **kw, **kwargs)

    build.__name__ = "MuonLP"
    return build
