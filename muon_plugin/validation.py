"""Param-group settings as the optimizer accepts them: torch.optim's names, numbers, checks.

Everything here raises ValueError naming the key, the value or the parameter at fault: the
settings at construction (or ``add_param_group``), the gradients' layouts at each step, before
the step could fail obscurely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.defaults import (
    ALGORITHMS,
    DEFAULTS,
    LR_ADJUSTMENTS,
    NORMALIZATIONS,
    NORMUON_RESCALES,
)
from muon_plugin.errors import SettingError
from muon_plugin.group_settings import group_spec
from muon_plugin.orthogonalize import validate_backend, validate_coefficients, validate_steps
from muon_plugin.parameters import describe

TORCH_GROUP_KEYS = {"params", "param_names", "initial_lr"}
"""Keys torch.optim or LR schedulers put into groups themselves."""

SYNONYMS: dict[str, str] = {
    "weight_decay": "wd",
    "adjust_lr_fn": "lr_adjust",
    "eps": "ns_eps",
    "betas": "adam_betas",
}
"""torch.optim's names for our settings (torch.optim.Muon's, and Adam's ``betas``), accepted in
the constructor and in param groups and stored under our names. ``eps`` is torch.optim.Muon's
Newton-Schulz epsilon in Muon groups and Adam's epsilon in Adam/AdamW groups."""

TORCH_LR_ADJUST = {None: "keller", "original": "keller", "match_rms_adamw": "match_rms_adamw"}
"""torch.optim.Muon's ``adjust_lr_fn`` values (None is its default, "original")."""

NUMBER_KEYS = ("lr", "wd", "adam_eps", "ns_eps", "normuon_eps")
"""Settings that must be a number >= 0 (or a one-element Tensor holding one)."""


def synonym_of(name: str, algorithm: str) -> str:
    """Our key for torch.optim's setting ``name`` in a group of ``algorithm``."""
    if name == "eps" and algorithm != "muon":
        return "adam_eps"
    return SYNONYMS[name]


def resolve_synonyms(settings: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``settings`` with torch.optim's names replaced by ours (values translated).

    Raises ValueError naming both keys when a setting is given under both names.
    """
    algorithm = settings.get("algorithm", DEFAULTS["algorithm"])
    out = dict(settings)
    for name in SYNONYMS:
        if name not in out:
            continue
        ours = synonym_of(name, algorithm)
        if ours in out:
            raise SettingError(
                ours,
                f"{where}: both {name!r} and {ours!r} are given, but they are one setting "
                f"({name!r} is torch.optim's name for {ours!r}); give only one",
            )
        value = out.pop(name)
        if name == "adjust_lr_fn":
            value = torch_lr_adjust(value)
        out[ours] = value
    return out


def torch_lr_adjust(value: Any) -> str:
    """Our ``lr_adjust`` for torch.optim.Muon's ``adjust_lr_fn`` value (ours are accepted too)."""
    if value in TORCH_LR_ADJUST:
        return TORCH_LR_ADJUST[value]
    if value in LR_ADJUSTMENTS:
        return value
    raise SettingError(
        "lr_adjust",
        f"Adjust learning rate function {value} is not supported: adjust_lr_fn must be one of "
        f"{sorted(k for k in TORCH_LR_ADJUST if k)} or None (or lr_adjust one of "
        f"{LR_ADJUSTMENTS})",
    )


def check_group_keys(group: Mapping[str, Any], index: int) -> None:
    """Raise ValueError naming the first key of param group ``index`` that is no setting."""
    unknown = set(group) - set(DEFAULTS) - TORCH_GROUP_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise SettingError(
            key,
            f"param group {index}: unknown key {key!r}; known keys: "
            f"{sorted(set(DEFAULTS) | {'params'})} and torch.optim's names "
            f"{sorted(SYNONYMS)}",
        )


def check_unique_params(group: Mapping[str, Any], index: int) -> None:
    """Raise ValueError naming a parameter that appears twice in param group ``index`` (torch
    only warns, then updates it twice per step)."""
    seen: dict[int, int] = {}
    for i, p in enumerate(group["params"]):
        first = seen.setdefault(id(p), i)
        if first != i:
            raise ValueError(
                f"param group {index}: {describe(group, i, p)} appears twice (positions "
                f"{first} and {i}); give each parameter once (it would be updated twice per "
                "step)"
            )


def normalize_group(group: dict[str, Any]) -> None:
    """Store the sequence settings of ``group`` as tuples (hashable, comparable)."""
    for key in ("split_sizes", "ns_coefficients"):
        if group[key] is not None:
            group[key] = tuple(group[key])
    group["adam_betas"] = tuple(group["adam_betas"])


def validate_number(key: str, value: Any) -> None:
    """Raise ValueError naming ``key`` unless ``value`` is a number >= 0 or a one-element
    Tensor holding one."""
    number = value
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise SettingError(
                key,
                f"Tensor {key} must be 1-element (a number or a one-element Tensor), got "
                f"a Tensor of shape {tuple(value.shape)}",
            )
        number = value.item()
    if not isinstance(number, (int, float)) or math.isnan(number) or number < 0:
        raise SettingError(key, f"{key} must be a number >= 0, got {value!r}")


def validate_group(group: Mapping[str, Any]) -> None:
    """Raise ValueError naming the key, value or parameter that makes ``group`` unusable."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise SettingError(
            "algorithm", f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}"
        )
    for key in NUMBER_KEYS:
        validate_number(key, group[key])
    betas = group["adam_betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise SettingError("adam_betas", f"adam_betas must be two numbers in [0, 1), got {betas!r}")
    if algorithm == "muon":
        validate_muon_settings(group)
        for i, p in enumerate(group["params"]):
            validate_muon_param(group, i, p)


def validate_muon_settings(group: Mapping[str, Any]) -> None:
    """Raise ValueError naming the Muon setting of ``group`` that cannot run."""
    if not 0.0 <= group["momentum"] < 1.0:
        raise SettingError("momentum", f"momentum must be in [0, 1), got {group['momentum']!r}")
    validate_steps(group["ns_steps"], group["orthogonalization_strategy"])
    validate_coefficients(group["ns_coefficients"])
    validate_backend(group["backend"])
    if group["lr_adjust"] not in LR_ADJUSTMENTS:
        raise SettingError(
            "lr_adjust",
            f"unknown lr_adjust {group['lr_adjust']!r}; expected one of {LR_ADJUSTMENTS}",
        )
    if group["normalization"] not in NORMALIZATIONS:
        raise SettingError(
            "normalization",
            f"unknown normalization {group['normalization']!r}; expected one of {NORMALIZATIONS}",
        )
    beta2 = group["normuon_beta2"]
    if isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or not 0.0 <= beta2 < 1.0:
        raise SettingError(
            "normuon_beta2", f"normuon_beta2 must be a number in [0, 1), got {beta2!r}"
        )
    if group["normuon_rescale"] not in NORMUON_RESCALES:
        raise SettingError(
            "normuon_rescale",
            f"unknown normuon_rescale {group['normuon_rescale']!r}; expected one of "
            f"{NORMUON_RESCALES}",
        )
    split = group["split_sizes"]
    if split is not None and (not split or not all(isinstance(s, int) and s > 0 for s in split)):
        raise SettingError("split_sizes", f"split_sizes must be positive integers, got {split!r}")


def validate_muon_param(group: Mapping[str, Any], i: int, p: Tensor) -> None:
    """Raise ValueError naming the ``i``-th parameter of a Muon group unless Muon can update
    it: a real floating-point matrix (or stack) whose rows ``split_sizes`` add up to."""
    if p.is_complex():
        raise ValueError(
            f"Muon does not support complex parameters: {describe(group, i, p)}; put it "
            "in a group with algorithm='adamw'"
        )
    if p.ndim < 2:
        raise ValueError(
            f"Muon needs matrices (>= 2-D) but got {describe(group, i, p)}; "
            "put it in a group with algorithm='adamw'"
        )
    if not p.is_floating_point():
        raise ValueError(f"Muon cannot update non-floating-point {describe(group, i, p)}")
    split = group["split_sizes"]
    if split is None:
        return
    rows = group_spec(group).matrix_view(tuple(p.shape))[1]
    if sum(split) != rows:
        raise ValueError(
            f"split_sizes {split} sum to {sum(split)} but {describe(group, i, p)} has {rows} rows"
        )


def check_grad_layouts(group: Mapping[str, Any], params: Sequence[Tensor]) -> None:
    """Raise ValueError when a DTensor gradient is not laid out like its parameter.

    The momentum math runs on local shards, which is only right when the gradient's shard is
    the parameter's shard (a ``Partial`` gradient, say, would be summed into momentum unreduced).
    """
    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and (
            not isinstance(g, DTensor)
            or g.placements != p.placements
            or g.device_mesh != p.device_mesh
        ):
            i = next(i for i, q in enumerate(group["params"]) if q is p)
            got = tuple(g.placements) if isinstance(g, DTensor) else type(g).__name__
            raise ValueError(
                f"the gradient of {describe(group, i, p)} has placements {got} but the parameter "
                f"has {tuple(p.placements)}; redistribute the gradient to the parameter's "
                "placements before the optimizer step"
            )
