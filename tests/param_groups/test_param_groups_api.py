"""The plugin's param-group rules for library users (no torchtitan) and the rule table."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import muon_plugin
from muon_plugin import Muon, muon_param_groups
from muon_plugin.param_groups.options import MuonConfig, validate_job_optimizer
from muon_plugin.param_groups.rules_table import format_rules_table, muon_lr_range


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16, bias=True) for _ in range(2)])
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def by_algorithm(groups: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for g in groups:
        out.setdefault(g["algorithm"], set()).update(g["param_names"])
    return out


def test_library_groups_follow_the_plugin_rules_and_step() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    groups = muon_param_groups(model, lr=0.02, weight_decay=0.1, norm_weight_decay=0.0)
    algo = by_algorithm(groups)
    assert algo["muon"] == {"layers.0.weight", "layers.1.weight"}
    assert {"output.weight", "tok_embeddings.weight", "norm.weight", "layers.0.bias"} <= algo[
        "adamw"
    ]
    norm = next(g for g in groups if "norm.weight" in g["param_names"])
    assert norm["wd"] == 0.0 and norm["lr"] == 0.02
    assert muon_plugin.muon_param_groups is muon_param_groups
    opt = Muon(groups)
    before = model.output.weight.detach().clone()
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    opt.step()
    assert not torch.equal(before, model.output.weight)


def test_library_groups_options_and_errors() -> None:
    model = TinyLM()
    groups = muon_param_groups(model, lr=0.02, output_algorithm="muon")
    assert "output.weight" in by_algorithm(groups)["muon"]
    with pytest.raises(TypeError, match=r"'norm_weight_decy'.*did you mean 'norm_weight_decay'"):
        muon_param_groups(model, lr=0.02, norm_weight_decy=0.0)
    with pytest.raises(ValueError, match=r"output_patterns: pattern 'head\.\*' matches no"):
        muon_param_groups(model, lr=0.02, output_patterns=["head.*"])
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        muon_param_groups(model, lr=-1.0)


def test_table_shows_the_effective_muon_lr() -> None:
    a, b = nn.Parameter(torch.zeros(256, 256)), nn.Parameter(torch.zeros(512, 256))
    v = nn.Parameter(torch.zeros(256))
    groups = [
        {"params": [a, b], "algorithm": "muon", "lr": 0.01, "wd": 0.1,
         "lr_adjust": "match_rms_adamw", "flatten": False},
        {"params": [v], "algorithm": "adamw", "lr": 0.01, "wd": 0.0},
    ]  # fmt: skip
    lo, hi = muon_lr_range(groups[0])
    assert lo == pytest.approx(0.01 * 0.2 * 16) and hi == pytest.approx(0.01 * 0.2 * 512**0.5)
    assert muon_lr_range(groups[1]) is None
    lines = format_rules_table(groups, ["matrix", "norm"]).splitlines()
    assert lines[2].split() == ["matrix", "muon", "2", "196,608", "0.01", "0.032-0.0453", "0.1"]
    assert lines[3].split() == ["norm", "adamw", "1", "256", "0.01", "-", "0"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, r"optimizer\.lr: invalid value -1\.0"),
        ({"lr": float("nan")}, r"optimizer\.lr: invalid value nan"),
        ({"weight_decay": -0.1}, r"optimizer\.weight_decay: invalid value -0\.1"),
        ({"eps": "x"}, r"optimizer\.eps: invalid value 'x'"),
        ({"beta1": 1.0}, r"optimizer\.beta1: invalid value 1\.0; expected a number in \[0, 1\)"),
        ({"beta2": -0.5}, r"optimizer\.beta2: invalid value -0\.5"),
        ({"implementation": "fast"}, r"optimizer\.implementation: invalid value 'fast'"),
    ],
)
def test_job_optimizer_errors_name_the_key(kwargs: dict, message: str) -> None:
    good = dict(lr=1e-3, weight_decay=0.1, eps=1e-8, beta1=0.9, beta2=0.95)
    validate_job_optimizer(**good)
    with pytest.raises(ValueError, match=message):
        validate_job_optimizer(**{**good, **kwargs})


def test_skip_nonfinite_option() -> None:
    assert MuonConfig().skip_nonfinite is False
    assert MuonConfig(skip_nonfinite=True).skip_nonfinite is True
    with pytest.raises(ValueError, match=r"optimizer\.muon\.skip_nonfinite: invalid value 'yes'"):
        MuonConfig(skip_nonfinite="yes")
