"""What a Muon param group's settings build: its orthogonalization spec and its elementwise
settings, and the settings the ranks of a mesh must agree on.

:func:`group_spec` is the one place that maps group settings to a
:class:`~muon_plugin.orthogonalize.MatrixSpec`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from muon_plugin.functional import GroupSettings
from muon_plugin.orthogonalize import MatrixSpec, elementwise_kernels_allowed, with_overrides
from muon_plugin.orthogonalize.spec import RowNormalization

AGREED_GROUP_KEYS = ("momentum", "nesterov", "wd", "use_cautious_wd")
"""Group settings of the elementwise math, besides the spec, that every rank of a mesh must
share (checked when a plan is built; ``lr`` is left out: schedulers change it every step)."""


def scalar(value: Any) -> Any:
    """A one-element Tensor hyperparameter as a 0-dim Tensor (as torch.optim does), else as is."""
    return value.squeeze() if isinstance(value, Tensor) and value.dim() != 0 else value


def plain(value: Any) -> Any:
    """A group setting as a Python number when it is a one-element Tensor (device-free repr)."""
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


def group_spec(group: Mapping[str, Any], overrides: frozenset[str] = frozenset()) -> MatrixSpec:
    """The orthogonalization spec of a Muon group; ``overrides``: the features the environment
    switched off when the optimizer was built (``environment_overrides``), folded into the
    backend's name."""
    split = group["split_sizes"]
    coefficients = group["ns_coefficients"]
    return _spec(
        steps=group["ns_steps"],
        strategy=group["orthogonalization_strategy"],
        lr_adjust=group["lr_adjust"],
        flatten=group["flatten"],
        split_sizes=None if split is None else tuple(split),
        compile=group["compile"],
        coefficients=None if coefficients is None else tuple(float(c) for c in coefficients),
        eps=float(group["ns_eps"]),
        backend=effective_backend(group["backend"], overrides),
        normalization=row_normalization(group),
    )


def row_normalization(group: Mapping[str, Any]) -> RowNormalization | None:
    """The row normalization of a Muon group (NorMuon), or None (plain Muon)."""
    if group["normalization"] == "none":
        return None
    return RowNormalization(
        beta2=float(group["normuon_beta2"]),
        eps=float(group["normuon_eps"]),
        rescale=group["normuon_rescale"],
    )


@functools.lru_cache(maxsize=256)
def _spec(**settings: Any) -> MatrixSpec:
    """One spec object per setting: the step's plan key then compares specs by identity."""
    return MatrixSpec(**settings)


@functools.lru_cache(maxsize=256)
def effective_backend(name: str, overrides: frozenset[str]) -> str:
    """The backend a group runs on: its own, less the features the overrides switch off."""
    return with_overrides(name, overrides) if overrides else name


def group_settings(
    group: Mapping[str, Any], size: int, overrides: frozenset[str] = frozenset()
) -> GroupSettings:
    """The elementwise settings of a Muon group, for ``size`` of its parameters
    (``overrides`` as in :func:`group_spec`)."""
    return GroupSettings(
        size=size,
        lr=scalar(group["lr"]),
        weight_decay=group["wd"],
        momentum=group["momentum"],
        nesterov=group["nesterov"],
        cautious=group["use_cautious_wd"],
        kernels=elementwise_kernels_allowed(effective_backend(group["backend"], overrides)),
    )


def agreed_settings(group: Mapping[str, Any]) -> dict[str, Any]:
    """The group's settings the ranks of a mesh must agree on, as plain values."""
    return {k: plain(group[k]) for k in AGREED_GROUP_KEYS}
