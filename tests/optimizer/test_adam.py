"""Adam/AdamW groups (muon_plugin.adam) step like torch.optim.Adam / AdamW, is_adamw included."""

from __future__ import annotations

import pytest
import torch

from muon_plugin import Muon, MuonForeach


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((16, 8), (8,), (2, 3, 4))]


def run(opt, ps, steps: int = 4) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


REFERENCE = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)


@pytest.mark.parametrize("driver", [Muon, MuonForeach])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    ("algorithm", "is_adamw", "reference"),
    [
        ("adamw", True, torch.optim.AdamW),  # decoupled decay
        ("adamw", False, torch.optim.Adam),  # coupled: weight decay added to the gradient
        ("adam", True, torch.optim.Adam),  # "adam" is always coupled
    ],
)
def test_is_adamw_picks_decoupled_or_coupled_decay(driver, fused, algorithm, is_adamw, reference):
    ours, theirs = params(), params()
    group = {"params": ours, "algorithm": algorithm, "is_adamw": is_adamw}
    opt = driver([group], lr=1e-2, adam_betas=(0.8, 0.99), adam_eps=1e-6, wd=0.3, fused_adam=fused)
    run(opt, ours)
    run(reference(theirs, **REFERENCE), theirs)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_is_adamw_changes_the_result_and_is_a_constructor_default():
    coupled, decoupled, default = params(), params(), params()
    run(Muon([{"params": coupled, "algorithm": "adamw"}], wd=0.3, is_adamw=False), coupled)
    run(Muon([{"params": decoupled, "algorithm": "adamw"}], wd=0.3, is_adamw=True), decoupled)
    run(Muon([{"params": default, "algorithm": "adamw"}], wd=0.3), default)
    assert not torch.equal(coupled[0], decoupled[0])
    assert all(torch.equal(a, b) for a, b in zip(default, decoupled, strict=True))


def test_adam_state_is_created_at_the_first_step_with_a_gradient():
    ps = params()
    opt = MuonForeach([{"params": ps, "algorithm": "adamw"}], fused_adam=False)
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    assert set(opt.state[ps[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[ps[0]]["step"].item() == 1.0 and opt.state[ps[0]]["step"].device.type == "cpu"
    assert ps[1] not in opt.state
