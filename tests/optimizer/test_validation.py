"""Param-group validation (muon_plugin.validation): torch.optim's names, numbers, group checks."""

from __future__ import annotations

import math

import pytest
import torch

from muon_plugin.defaults import DEFAULTS
from muon_plugin.validation import (
    check_group_keys,
    normalize_group,
    resolve_synonyms,
    torch_lr_adjust,
    validate_group,
    validate_number,
)


def group(*params: torch.Tensor, **settings) -> dict:
    """A group as the optimizer holds it: every setting present."""
    return {**DEFAULTS, "params": list(params), **settings}


MATRIX = torch.zeros(6, 4)


@pytest.mark.parametrize(
    ("given", "algorithm", "ours"),
    [
        ({"weight_decay": 0.2}, "muon", {"wd": 0.2}),
        ({"adjust_lr_fn": "original"}, "muon", {"lr_adjust": "keller"}),
        ({"adjust_lr_fn": None}, "muon", {"lr_adjust": "keller"}),
        ({"adjust_lr_fn": "match_rms_adamw"}, "muon", {"lr_adjust": "match_rms_adamw"}),
        ({"adjust_lr_fn": "spectral"}, "muon", {"lr_adjust": "spectral"}),
        ({"eps": 1e-5}, "muon", {"ns_eps": 1e-5}),
        ({"eps": 1e-5}, "adamw", {"adam_eps": 1e-5}),
        ({"betas": (0.8, 0.9)}, "adam", {"adam_betas": (0.8, 0.9)}),
    ],
)
def test_torch_names_become_ours(given, algorithm, ours):
    assert resolve_synonyms({**given, "algorithm": algorithm}, "here") == {
        **ours,
        "algorithm": algorithm,
    }


def test_one_setting_under_both_names_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"here: both 'eps' and 'adam_eps' are given"):
        resolve_synonyms({"algorithm": "adamw", "eps": 1e-6, "adam_eps": 1e-7}, "here")
    with pytest.raises(ValueError, match=r"Adjust learning rate function x is not supported"):
        torch_lr_adjust("x")


def test_unknown_group_keys_are_named():
    check_group_keys({"params": [], "param_names": [], "initial_lr": 0.1, "lr": 0.1}, 0)
    with pytest.raises(ValueError, match=r"param group 3: unknown key 'nesterof'"):
        check_group_keys({"params": [], "nesterof": True}, 3)


def test_sequence_settings_are_stored_as_tuples():
    g = group(MATRIX, split_sizes=[2, 4], ns_coefficients=[3.0, -4.0, 2.0], adam_betas=[0.9, 0.9])
    normalize_group(g)
    assert (g["split_sizes"], g["ns_coefficients"], g["adam_betas"]) == (
        (2, 4),
        (3.0, -4.0, 2.0),
        (0.9, 0.9),
    )


@pytest.mark.parametrize("value", [0, 0.5, torch.tensor(0.1), torch.tensor([0.1])])
def test_numbers_and_one_element_tensors_are_accepted(value):
    validate_number("lr", value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1.0, r"lr must be a number >= 0, got -1\.0"),
        (math.nan, r"lr must be a number >= 0, got nan"),
        ("0.1", r"lr must be a number >= 0, got '0\.1'"),
        (torch.tensor([0.1, 0.2]), r"Tensor lr must be 1-element .* shape \(2,\)"),
    ],
)
def test_bad_numbers_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        validate_number("lr", value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"algorithm": "sgd"}, r"unknown algorithm 'sgd'"),
        ({"wd": -0.1}, r"wd must be a number >= 0"),
        ({"adam_betas": (0.9, 1.0)}, r"adam_betas must be two numbers in \[0, 1\)"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"ns_steps": 0}, r"ns_steps"),
        ({"orthogonalization_strategy": "svd"}, r"svd"),
        ({"ns_coefficients": (1.0, 2.0)}, r"coefficients"),
        ({"lr_adjust": "moonlight"}, r"unknown lr_adjust 'moonlight'"),
        ({"split_sizes": (4, 0)}, r"split_sizes must be positive integers"),
        ({"split_sizes": (2, 2)}, r"split_sizes \(2, 2\) sum to 4 but parameter #0 .* has 6 rows"),
    ],
)
def test_bad_muon_group_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        validate_group(group(MATRIX, **settings))


@pytest.mark.parametrize(
    ("param", "message"),
    [
        (torch.zeros(4, 4, dtype=torch.complex64), r"complex parameters: parameter 'w' \(shape"),
        (torch.zeros(4), r"needs matrices \(>= 2-D\) but got parameter 'w' \(shape \(4,\)"),
        (torch.zeros(4, 4, dtype=torch.int32), r"non-floating-point parameter 'w' \(shape"),
    ],
)
def test_parameters_muon_cannot_update_are_named(param, message):
    with pytest.raises(ValueError, match=message):
        validate_group(group(param, param_names=["w"]))


def test_adam_groups_take_vectors_and_skip_the_muon_checks():
    validate_group(group(torch.zeros(4), algorithm="adamw", momentum=2.0, lr_adjust="x"))


def test_split_sizes_count_the_rows_of_the_matrix_view():
    stack = torch.zeros(3, 6, 4)  # a batch of 6 x 4 matrices; flattened, one 3 x 24 matrix
    validate_group(group(stack, split_sizes=(2, 4)))
    validate_group(group(stack, split_sizes=(1, 2), flatten=True))
    with pytest.raises(ValueError, match="has 3 rows"):
        validate_group(group(stack, split_sizes=(2, 4), flatten=True))
