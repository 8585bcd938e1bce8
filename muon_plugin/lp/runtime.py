"""Running a format's update function eager or under ``torch.compile``, and its constant tables.

``compile=True`` compiles the momentum update too: one fused graph per function and input
size (static shapes), where eager requantization runs tens of small kernels.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


@functools.cache
def compiled_update(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compile`` (static shapes, the whole update in one graph)."""
    # torch warns once per torchao subclass about AOT-autograd cache keys; it is harmless here.
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    return torch.compile(fn, fullgraph=True, dynamic=False)


def run(fn: Callable[..., Any], compiled: bool, *args: Any) -> Any:
    """``fn(*args)``, compiled (:func:`compiled_update`) when ``compiled``."""
    if not compiled:
        return fn(*args)
    # One graph per distinct size (static shapes: inductor's CPU codegen can stall on the
    # symbolic block indexing of dynamic ones); a model has few distinct sizes.
    from torch._dynamo.utils import disable_cache_limit

    with disable_cache_limit():
        return compiled_update(fn)(*args)


_TABLES: dict[tuple[str, torch.device], Tensor] = {}


def table(name: str, build: Callable[[], Tensor], device: torch.device) -> Tensor:
    """The constant lookup table ``name`` (made on the CPU by ``build``), one copy per device."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = build().to(device)
    return _TABLES[key]
