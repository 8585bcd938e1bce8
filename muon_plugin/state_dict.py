"""Loading an optimizer state dict: matched by name, checked, momentum kept in its format.

The steps of :meth:`muon_plugin.optimizer.Muon.load_state_dict` around ``torch.optim``'s own:

- :func:`match_by_name`: when every saved and every live group carries ``param_names``, state
  is matched by name (a parameter may sit at another position, or in another group); a name on
  one side only is an error naming it. Otherwise it is matched by position, as torch does.
- :func:`hold_out_momentum`: every entry is checked against its parameter (shape, dtype) and
  the momentum entries are held out of ``torch.optim``'s cast to the parameter dtype (which
  would turn the fp32 momentum of bf16 parameters into bf16, and MuonLP's codes into floats).
- :func:`restore_momentum`: the held momentum, converted by the optimizer, goes back into the
  state; :func:`fill_missing_settings` and :func:`place_fused_adam_steps` finish the groups.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from muon_plugin.defaults import DEFAULTS
from muon_plugin.parameters import describe

PARAM_SHAPED_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
"""State keys whose tensors have their parameter's shape."""

Groups = Sequence[Mapping[str, Any]]


def match_by_name(state_dict: dict[str, Any], param_groups: Groups) -> dict[str, Any]:
    """``state_dict`` with each saved group's ``params`` in the live order, matched by name.

    Returned unchanged unless every saved and every live group carries ``param_names``.
    """
    saved_groups = state_dict["param_groups"]
    if not saved_groups or not all("param_names" in g for g in chain(saved_groups, param_groups)):
        return state_dict
    saved_ids = _saved_ids_by_name(saved_groups)
    _check_same_names([n for g in param_groups for n in g["param_names"]], saved_ids)
    groups = []
    for saved_group, group in zip(saved_groups, param_groups, strict=False):
        names = list(group["param_names"])
        groups.append(
            {**saved_group, "params": [saved_ids[n] for n in names], "param_names": names}
        )
    groups += saved_groups[len(groups) :]
    return {**state_dict, "param_groups": groups}


def _saved_ids_by_name(saved_groups: Groups) -> dict[str, Any]:
    """``name -> saved parameter id`` over every saved group (names must be unique)."""
    saved_ids: dict[str, Any] = {}
    for gi, g in enumerate(saved_groups):
        names = g["param_names"]
        if len(names) != len(g["params"]):
            raise ValueError(
                f"loaded state dict: parameter group {gi} has {len(g['params'])} "
                f"parameters but {len(names)} param_names"
            )
        for name, pid in zip(names, g["params"], strict=True):
            if name in saved_ids:
                raise ValueError(f"loaded state dict names parameter {name!r} twice")
            saved_ids[name] = pid
    return saved_ids


def _check_same_names(live: list[str], saved_ids: Mapping[str, Any]) -> None:
    """Raise ValueError naming a parameter named twice live, or on one side only."""
    if len(set(live)) != len(live):
        dup = next(n for n in live if live.count(n) > 1)
        raise ValueError(f"the optimizer names parameter {dup!r} twice")
    missing = [n for n in live if n not in saved_ids]
    if missing:
        raise ValueError(
            f"loaded state dict has no parameter {missing[0]!r} (of {len(missing)} missing); "
            "its state would silently start from zero"
        )
    extra = [n for n in saved_ids if n not in set(live)]
    if extra:
        raise ValueError(
            f"loaded state dict has parameter {extra[0]!r} (of {len(extra)}) that this "
            "optimizer does not have; its state would be silently dropped"
        )


def check_group_sizes(saved_groups: Groups, param_groups: Groups) -> None:
    """Raise ValueError unless the saved groups hold as many parameters as the live ones."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(param_groups)}"
        )
    for i, (saved_group, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError(
                f"loaded state dict: parameter group {i} has {len(saved_group['params'])} "
                f"parameters, the optimizer's {len(group['params'])}"
            )


def check_state_entry(
    p: Tensor,
    entry: Mapping[str, Any],
    group: Mapping[str, Any],
    i: int,
    momentum_keys: tuple[str, ...],
) -> None:
    """Raise ValueError naming ``p`` and the key when a saved state tensor cannot be its state.

    Parameter-shaped entries (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) must have the
    parameter's (global) shape and a floating dtype, complex for a complex parameter; other
    momentum formats are checked when they are converted.
    """
    for key, value in entry.items():
        if not isinstance(value, Tensor) or key not in PARAM_SHAPED_KEYS:
            continue
        if key == "momentum_buffer" and key not in momentum_keys:
            continue
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"cannot load the state of {describe(group, i, p)}: {key!r} has shape "
                f"{tuple(value.shape)}"
            )
        ok = value.is_complex() if p.is_complex() else value.is_floating_point()
        if not ok:
            raise ValueError(
                f"cannot load the state of {describe(group, i, p)}: {key!r} has dtype {value.dtype}"
            )


def hold_out_momentum(
    state_dict: dict[str, Any], param_groups: Groups, momentum_keys: tuple[str, ...]
) -> tuple[dict[str, Any], dict[Tensor, dict[str, Tensor]]]:
    """Check every saved entry against its live parameter and take the momentum out of it.

    Returns the state dict without the momentum entries and, per live parameter, its saved
    momentum entries.
    """
    id_map = dict(
        zip(
            chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
            chain.from_iterable(g["params"] for g in param_groups),
            strict=True,
        )
    )
    where = positions(param_groups)
    state: dict[Any, Any] = {}
    held: dict[Tensor, dict[str, Tensor]] = {}
    for key, entry in state_dict["state"].items():
        p = id_map.get(key)
        if p is not None and isinstance(entry, dict):
            check_state_entry(p, entry, *where[id(p)], momentum_keys)
            momentum = {k: v for k, v in entry.items() if k in momentum_keys}
            if momentum:
                held[p] = momentum
                entry = {k: v for k, v in entry.items() if k not in momentum}
        state[key] = entry
    return {**state_dict, "state": state}, held


def positions(param_groups: Groups) -> dict[int, tuple[Mapping[str, Any], int]]:
    """``id(p) -> (group, index in the group)`` for every live parameter."""
    return {id(p): (g, i) for g in param_groups for i, p in enumerate(g["params"])}


def restore_momentum(
    held: Mapping[Tensor, dict[str, Tensor]],
    where: Mapping[int, tuple[Mapping[str, Any], int]],
    state: dict[Tensor, dict[str, Any]],
    convert: Callable[[Tensor, dict[str, Tensor]], dict[str, Tensor]],
) -> None:
    """Put each parameter's held momentum, converted by ``convert``, into its state.

    ``where``: the parameters' :func:`positions`, which name them when ``convert`` raises
    ValueError.
    """
    with torch.no_grad():
        for p, saved in held.items():
            try:
                restored = convert(p, saved)
            except ValueError as e:
                raise ValueError(
                    f"cannot load the state of {describe(*where[id(p)], p)}: {e}"
                ) from e
            state[p].update(restored)


def warn_missing_state(param_groups: Groups, state: Mapping[Tensor, Mapping[str, Any]]) -> None:
    """Warn, naming them, about parameters a loaded state dict gave no state while it gave
    state to others: their momentum (Adam moments) restarts from zero. A state dict without
    any state (saved before the first step) starts every parameter afresh, without a word."""
    if not any(state.get(p) for g in param_groups for p in g["params"]):
        return
    missing = [
        describe(g, i, p)
        for g in param_groups
        for i, p in enumerate(g["params"])
        if p.requires_grad and not state.get(p)
    ]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        warnings.warn(
            f"loaded state dict has no state for {missing[0]}{more}: its "
            "optimizer state (momentum) starts from zero",
            stacklevel=3,
        )


def fill_missing_settings(param_groups: Groups, defaults: Mapping[str, Any]) -> None:
    """Give groups saved before a setting existed its default."""
    for group in param_groups:
        for key in DEFAULTS:
            if key in defaults:
                group.setdefault(key, defaults[key])  # type: ignore[attr-defined]


def place_fused_adam_steps(param_groups: Groups, state: dict[Tensor, dict[str, Any]]) -> None:
    """Move Adam's ``step`` of fused-Adam groups to the parameter's device, as fp32.

    torch.optim keeps Adam's step where it was saved unless a group says ``"fused"``; ours says
    ``"fused_adam"``, and the fused kernel wants it on the parameter's device.
    """
    for group in param_groups:
        if group["algorithm"] != "muon" and group["fused_adam"]:
            for p in group["params"]:
                if "step" in state.get(p, {}):
                    state[p]["step"] = state[p]["step"].to(torch.float32).to(p.device)
