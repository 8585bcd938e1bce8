"""One source of truth: the constructor, the option schema and the plugins read
muon_plugin.defaults; none restates a choice or a default."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import torch

from muon_plugin import Muon
from muon_plugin import defaults as D
from muon_plugin.param_groups.builder import BaseHyperparams, optimizer_kwargs
from muon_plugin.param_groups.options import MuonConfig

# MuonConfig option -> the optimizer setting it configures (same default).
SHARED = {
    "orthogonalization": "orthogonalization_strategy",
    "ns_steps": "ns_steps",
    "momentum": "momentum",
    "nesterov": "nesterov",
    "cautious_weight_decay": "use_cautious_wd",
    "flatten": "flatten",
    "compile": "compile",
    "normalization": "normalization",
    "normuon_beta2": "normuon_beta2",
    "normuon_eps": "normuon_eps",
    "normuon_rescale": "normuon_rescale",
}


def option_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(MuonConfig)}


def test_the_constructor_defaults_are_defaults_py():
    opt = Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    assert opt.defaults == D.DEFAULTS
    signature = inspect.signature(Muon).parameters
    for key, value in D.DEFAULTS.items():
        if key in signature and signature[key].default is not None:
            assert signature[key].default == value, key
    assert signature["skip_nonfinite"].default is D.SKIP_NONFINITE


def test_the_option_schema_defaults_are_defaults_py():
    cfg = MuonConfig()
    for option, setting in SHARED.items():
        assert getattr(cfg, option) == D.DEFAULTS[setting], option
    assert cfg.lr_adjust == D.PLUGIN_LR_ADJUST
    assert cfg.implementation == D.PLUGIN_IMPLEMENTATION
    assert cfg.state_dtype == D.PLUGIN_STATE_DTYPE
    assert cfg.skip_nonfinite is D.SKIP_NONFINITE


def test_the_option_schema_choices_are_defaults_py_with_the_default_first():
    fields = option_fields()
    for option, allowed in (
        ("implementation", D.IMPLEMENTATIONS),
        ("orthogonalization", D.STRATEGIES),
        ("lr_adjust", D.LR_ADJUSTMENTS),
        ("state_dtype", D.STATE_DTYPES),
        ("normalization", D.NORMALIZATIONS),
        ("normuon_rescale", D.NORMUON_RESCALES),
    ):
        listed = typing.get_args(fields[option].type)
        assert sorted(listed) == sorted(allowed) and listed[0] == fields[option].default, option
    generated = fields["matrix_algorithm"].type  # Annotated[<choices> | None, Doc(help)]
    assert typing.get_origin(generated) is typing.Annotated
    algorithm = typing.get_args(typing.get_args(generated)[0])[0]
    assert typing.get_args(algorithm) == D.ALGORITHMS


def test_plugin_constructor_arguments_keep_the_optimizer_defaults():
    base = BaseHyperparams(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    kwargs = optimizer_kwargs(base, MuonConfig())
    opt = Muon([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
    differ = {k for k, v in opt.defaults.items() if v != D.DEFAULTS[k]}
    assert differ == {"lr_adjust"}  # the plugins' own rule
