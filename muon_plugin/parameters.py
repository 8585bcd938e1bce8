"""How the optimizer addresses a parameter: its local shard and its name in messages.

The elementwise math runs on local shards (a DTensor's ``to_local()``); errors and the
distributed plan name a parameter by its FQN when its group carries ``param_names``, else by
its position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from muon_plugin.distributed.layout import local

__all__ = ["describe", "local", "names_by_id", "param_name"]


def param_name(group: Mapping[str, Any], i: int, group_index: int | None = None) -> str:
    """The FQN of the ``i``-th parameter of ``group`` (from ``param_names``), else its
    position: ``#i``, or ``group g #i`` when ``group_index`` is given."""
    names = group.get("param_names")
    if names:
        return names[i]
    return f"#{i}" if group_index is None else f"group {group_index} #{i}"


def describe(group: Mapping[str, Any], i: int, p: Tensor) -> str:
    """A parameter for error messages: its quoted FQN (else its position), shape and dtype."""
    name = param_name(group, i)
    shown = repr(name) if group.get("param_names") else name
    return f"parameter {shown} (shape {tuple(p.shape)}, dtype {p.dtype})"


def names_by_id(param_groups: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """``id(p) -> name`` for every parameter of ``param_groups`` (positions as ``group g #i``)."""
    return {
        id(p): param_name(group, i, gi)
        for gi, group in enumerate(param_groups)
        for i, p in enumerate(group["params"])
    }
