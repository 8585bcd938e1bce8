"""Stricter checks of torch.optim's conventions on ``Muon`` and ``MuonForeach`` than torch's own
generic suite (``TestOptimRenewed``, run on both classes by
tests/optimizer/test_torch_optim_renewed.py).

The sample inputs are torch's own for ``torch.optim.Muon`` (``optim_inputs_func`` of its
``OptimizerInfo`` in ``torch.testing._internal.common_optimizers``), so every optimizer here is
built with torch.optim.Muon's argument names. Where torch's suite uses tolerances or one dtype,
these checks are exact and run in float32 and float64: a Tensor lr equals a float lr bit for bit,
a step without gradients or with zero gradients leaves the parameters exactly as they were, the
state dict round trip is deterministic and resumes bit for bit, a deep copy steps identically,
and param groups equal separate optimizers bit for bit (MuonForeach batches across groups).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau

from muon_plugin import Muon, MuonForeach

# torch's testing utilities import expecttest (a test dependency of torch, not of its wheel).
pytest.importorskip("expecttest", reason="torch.testing._internal needs the expecttest package")
from torch.testing._internal.common_optimizers import (  # noqa: E402
    optim_db,
)

MUON_INFO = next(info for info in optim_db if info.optim_cls is torch.optim.Muon)
DRIVERS = [Muon, MuonForeach]
DTYPES = [torch.float32, torch.float64]


def sample_inputs():
    return MUON_INFO.optim_inputs_func(device="cpu")


def input_ids():
    return [i.desc for i in sample_inputs()]


def fresh_kwargs(index: int) -> dict:
    """The kwargs of torch's sample input ``index`` (fresh: schedulers mutate a Tensor lr)."""
    return dict(sample_inputs()[index].kwargs)


def weight(dtype, contiguous: bool = True, seed: int = 0) -> Parameter:
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        return Parameter(torch.randn(10, 5, generator=g, dtype=dtype))
    return Parameter(torch.randn(10, 5, 2, generator=g, dtype=dtype)[..., 0])


def loss_of(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return w.mv(x).pow(2).sum()


def same(a, b) -> bool:
    """Exact equality of nested state-dict values (tensors bit for bit, dtypes included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def train(opt, w, x, steps: int, schedulers=()) -> float:
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(w, x)
        loss.backward()
        opt.step()
        for s in schedulers:
            s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
    return loss_of(w, x).item()


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("index", range(len(sample_inputs())), ids=input_ids())
def test_tensor_lr_equals_float_lr(driver, index):
    kwargs = fresh_kwargs(index)
    kwargs.pop("lr", None)
    w, wt = weight(torch.float32), weight(torch.float32)
    x = torch.randn(5, generator=torch.Generator().manual_seed(1))
    a = driver([w], lr=1e-3, **kwargs)
    b = driver([wt], lr=torch.tensor(1e-3), **kwargs)
    train(a, w, x, 5)
    train(b, wt, x, 5)
    assert torch.equal(w, wt)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_step_is_noop_without_grads_and_for_zero_grads(driver, dtype):
    for index in range(len(sample_inputs())):
        kwargs = fresh_kwargs(index)
        w = weight(dtype)
        before = w.detach().clone()
        opt = driver([w], **kwargs)
        opt.step()
        assert torch.equal(w, before)
        kwargs["weight_decay"] = 0.0
        opt = driver([w], **kwargs)
        w.grad = torch.zeros_like(w)
        opt.step()
        assert torch.equal(w, before)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(len(sample_inputs())), ids=input_ids())
def test_state_dict_is_deterministic_and_resumes_exactly(driver, dtype, index):
    w = weight(dtype)
    x = torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=dtype)
    opt = driver([w], **fresh_kwargs(index))
    train(opt, w, x, 3)
    wc = Parameter(w.detach().clone())
    optc = driver([wc], **fresh_kwargs(index))
    saved = copy.deepcopy(opt.state_dict())
    optc.load_state_dict(copy.deepcopy(saved))
    assert saved["state"].keys() == optc.state_dict()["state"].keys()
    for _ in range(3):
        train(opt, w, x, 1)
        train(optc, wc, x, 1)
        assert torch.equal(w, wc)
    assert same(opt.state_dict(), optc.state_dict())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    assert same(torch.load(buf), opt.state_dict())


@pytest.mark.parametrize("driver", DRIVERS)
def test_copies_keep_all_public_attributes_and_step_alike(driver):
    w = weight(torch.float32)
    x = torch.randn(5, generator=torch.Generator().manual_seed(1))
    opt = driver([w], **fresh_kwargs(0))
    train(opt, w, x, 2)

    def public(o):
        return {k for k in o.__dict__ if not k.startswith("_")}

    twin = copy.deepcopy(opt)
    assert public(twin) == public(opt)
    wt = twin.param_groups[0]["params"][0]
    train(opt, w, x, 2)
    train(twin, wt, x, 2)
    assert torch.equal(w, wt)


@pytest.mark.parametrize("driver", DRIVERS)
def test_param_groups_equal_separate_optimizers(driver):
    ws = [weight(torch.float32, seed=s) for s in (0, 1)]
    xs = [weight(torch.float32, seed=s) for s in (0, 1)]
    x = torch.randn(5, generator=torch.Generator().manual_seed(1))
    grouped = driver([{"params": [ws[0]]}, {"params": [ws[1]], "lr": 0.01, "weight_decay": 0.2}])
    alone = [driver([xs[0]]), driver([xs[1]], lr=0.01, weight_decay=0.2)]
    for _ in range(3):
        grouped.zero_grad()
        (loss_of(ws[0], x) + loss_of(ws[1], x)).backward()
        grouped.step()
        for opt, p in zip(alone, xs, strict=True):
            opt.zero_grad()
            loss_of(p, x).backward()
            opt.step()
    for a, b in zip(ws, xs, strict=True):
        assert torch.equal(a, b)
