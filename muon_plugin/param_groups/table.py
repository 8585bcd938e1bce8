"""Read an ``[optimizer.muon]`` table (a TOML file or a mapping) into a :class:`MuonConfig`.

The same table configures every release: torchtitan 0.2.2 reads it from its job TOML, torchtitan
0.3 from the file named by ``optimizer.muon_toml``. Nothing here imports torchtitan.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from muon_plugin.param_groups.options import MUON_CONFIG_KEYS, MuonConfig

__all__ = ["apply_table", "read_muon_table"]

_DEFAULTS = MuonConfig()


def read_muon_table(path: str | Path) -> dict[str, Any]:
    """The ``[optimizer.muon]`` table of a TOML file (a full job TOML or just that table).

    Raises ValueError naming the file when it has no such table.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"optimizer.muon_toml: file not found: {str(path)!r}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"optimizer.muon_toml: {str(path)!r} is not valid TOML: {e}") from None
    table = data.get("optimizer", {}).get("muon")
    if not isinstance(table, dict):
        raise ValueError(f"optimizer.muon_toml: {str(path)!r} has no [optimizer.muon] table")
    return table


def apply_table(cfg: MuonConfig, table: Mapping[str, Any]) -> MuonConfig:
    """``cfg`` with the table's values for every field ``cfg`` leaves at its default.

    Fields set to a non-default value in ``cfg`` (in Python or on the command line) win over
    the table. Unknown keys raise ValueError naming ``optimizer.muon.<key>``; values are checked
    by :meth:`MuonConfig.validate`.
    """
    unknown = sorted(set(table) - set(MUON_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"optimizer.muon.{unknown[0]}: unknown option (valid: {', '.join(MUON_CONFIG_KEYS)})"
        )
    updates = {
        key: value for key, value in table.items() if getattr(cfg, key) == getattr(_DEFAULTS, key)
    }
    return dataclasses.replace(cfg, **updates)
