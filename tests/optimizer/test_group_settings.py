"""What a Muon group builds (muon_plugin.group_settings): its spec and elementwise settings."""

from __future__ import annotations

import torch

from muon_plugin.defaults import DEFAULTS
from muon_plugin.group_settings import agreed_settings, group_settings, group_spec
from muon_plugin.learning_rate import LrShapeRule


def test_group_spec_maps_every_setting_and_is_shared_by_equal_groups():
    group = {
        **DEFAULTS,
        "ns_steps": 7,
        "orthogonalization_strategy": "newton_schulz",
        "lr_adjust": "spectral",
        "flatten": True,
        "split_sizes": [2, 3],
        "compile": True,
        "ns_coefficients": [3, -4, 2],
        "ns_eps": 1e-6,
    }
    spec = group_spec(group)
    assert (spec.steps, spec.strategy, spec.output_scale, spec.flatten, spec.compile) == (
        7,
        "newton_schulz",
        LrShapeRule("spectral"),
        True,
        True,
    )
    assert spec.split_sizes == (2, 3) and spec.coefficients == (3.0, -4.0, 2.0)
    assert spec.eps == 1e-6
    assert group_spec(dict(group)) is spec  # the plan cache compares specs by identity
    assert group_spec(DEFAULTS) is not spec


def test_group_settings_and_the_settings_ranks_agree_on():
    group = {**DEFAULTS, "lr": torch.tensor([0.5]), "wd": 0.2, "use_cautious_wd": False}
    s = group_settings(group, 3)
    assert s.size == 3 and s.lr.dim() == 0 and s.lr.item() == 0.5
    assert (s.weight_decay, s.momentum, s.nesterov, s.cautious) == (0.2, 0.95, True, False)
    agreed = agreed_settings({**group, "momentum": torch.tensor(0.9)})
    assert agreed == {"momentum": agreed["momentum"], "nesterov": True, "wd": 0.2,
                      "use_cautious_wd": False}  # fmt: skip
    assert isinstance(agreed["momentum"], float)
