"""The local paths a torchtitan job config reads (either release; imports no torchtitan).

``scripts/train.sh`` builds the local corpus (``scripts/prepare_data.py``) only when the job
reads it: when one of these paths lies in the corpus folder. The paths are every non-empty
string field named ``*_path`` of the parsed config, nested sections included (torchtitan 0.2.2:
``model.hf_assets_path``, ``model.tokenizer_path``, ``training.dataset_path``,
``validation.dataset_path``, ``checkpoint.initial_load_path``; torchtitan 0.3:
``hf_assets_path``, ``dataloader.dataset_path``, ``validator.*.dataset_path``, ...), so values
from the TOML or Python config and from command-line overrides count alike.
"""

from __future__ import annotations

import os
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = ["read_paths"]


def read_paths(config: Any) -> list[str]:
    """The ``*_path`` values of ``config`` (a dataclass tree, lists and tuples of dataclasses
    included), made absolute against the working directory with symlinks resolved, in field
    order and without repeats."""
    found: list[str] = []
    seen: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
            return
        if not is_dataclass(node) or isinstance(node, type) or id(node) in seen:
            return
        seen.add(id(node))
        for f in fields(node):
            value = getattr(node, f.name, None)
            if f.name.endswith("_path") and isinstance(value, str) and value:
                path = os.path.realpath(value)
                if path not in found:
                    found.append(path)
            else:
                walk(value)

    walk(config)
    return found
