"""The peers' rows: dion's Muon (gram Newton-Schulz or its Triton kernels, inside its CUDA-graph
wrapper) and gram-newton-schulz's Muon on a GPU, at their fastest documented settings; generic
peers (muonium, dtensor_muon) anywhere. A peer that does not import is skipped, with why."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from bench.config import LR, WD
from bench.row import Row


def _dion_graphed(ps: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """dion's Muon inside its CUDA-graph wrapper: two eager steps, then capture and replay."""
    from dion import Muon as DionMuon
    from dion.cuda_graph import CudaGraphOptimizer

    return CudaGraphOptimizer(DionMuon(ps, lr=LR, weight_decay=WD, **kwargs), warmup_steps=2)


def _gram_newton_schulz_muon(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from gram_newton_schulz import Muon as GramMuon

    return GramMuon(ps, lr=LR, weight_decay=WD)


PEERS: list[tuple[str, tuple[str, ...], Callable[[list[torch.nn.Parameter]], Any]]] = [
    (
        "dion Muon (gram NS, CUDA graph)",
        ("dion", "gram_newton_schulz"),
        lambda ps: _dion_graphed(ps, use_gram_newton_schulz=True),
    ),
    ("dion Muon (Triton, CUDA graph)", ("dion",), lambda ps: _dion_graphed(ps, use_triton=True)),
    ("gram_newton_schulz.Muon", ("gram_newton_schulz",), _gram_newton_schulz_muon),
]
"""Peers on a GPU at their fastest documented settings: (row, modules it needs, factory)."""

GENERIC_PEERS = [("muonium", ["Muon", "MuonForeach"]), ("dtensor_muon", ["Muon", "MuonForeach"])]
"""Peers whose classes take ``(params, lr=...)`` and run anywhere."""


def _missing(modules: tuple[str, ...]) -> str | None:
    """Why one of ``modules`` cannot be imported, or None when all can."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            return f"{module} not importable ({type(e).__name__})"
    return None


def peer_rows() -> list[Row]:
    rows = []
    for name, modules, make in PEERS:
        why = _missing(modules)
        if why is None and not torch.cuda.is_available():
            why = "needs a GPU"
        rows.append(Row(name, "peer", None if why else make, skip=why))
    for module, classes in GENERIC_PEERS:
        why = _missing((module,))
        mod = None if why else importlib.import_module(module)
        found = [c for c in classes if mod is not None and hasattr(mod, c)]
        if why is None and not found:
            why = f"no class among {classes}"
        if why:
            rows.append(Row(f"{module}.Muon", "peer", None, skip=why))
        for cls_name in found:
            cls = getattr(mod, cls_name)
            rows.append(Row(f"{module}.{cls_name}", "peer", lambda ps, cls=cls: cls(ps, lr=LR)))
    return rows
