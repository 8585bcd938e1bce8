"""Which rank orthogonalizes which whole matrix, and how updates reach it and come back.

A plan groups the Muon parameters of a step by (global shape, dtype, spec, layout) into shape
groups. It is built once and cached by the optimizer; ``run`` executes it every step.

This first version handles plain (non-DTensor) tensors: every matrix is local and whole, so a
shape group is one stacked (``batched=True``) or per-matrix orthogonalization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack


@dataclass
class ShapeGroup:
    """Parameters sharing a global shape, dtype and spec: orthogonalized as one stack."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: MatrixSpec
    indices: list[int] = field(default_factory=list)


@dataclass
class OrthogonalizationPlan:
    """A cached assignment of matrices to ranks; ``run`` maps updates to orthogonal updates."""

    groups: list[ShapeGroup]
    batched: bool

    def run(self, updates: Sequence[Tensor]) -> list[Tensor]:
        """Orthogonalize ``updates`` (local tensors laid out as their parameters), in bf16."""
        out: list[Tensor | None] = [None] * len(updates)
        for group in self.groups:
            if self.batched:
                stacked = torch.stack([updates[i] for i in group.indices])
                result = orthogonalize_stack(stacked, group.spec)
                for j, i in enumerate(group.indices):
                    out[i] = result[j]
            else:
                for i in group.indices:
                    out[i] = orthogonalize_stack(updates[i].unsqueeze(0), group.spec)[0]
        return out  # type: ignore[return-value]

    def report(self) -> list[dict]:
        """Per shape group: shape, matrices, matrices per rank, bytes moved, FLOPs per rank."""
        return [
            {
                "shape": g.shape,
                "dtype": str(g.dtype).removeprefix("torch."),
                "placements": "local",
                "matrices": len(g.indices),
                "matrices_per_rank": [len(g.indices)],
                "send_bytes_per_rank": [0],
                "recv_bytes_per_rank": [0],
                "flops_per_rank": [len(g.indices) * g.spec.flops(g.shape)],
            }
            for g in self.groups
        ]


def plan_orthogonalization(
    params: Sequence[Tensor], specs: Sequence[MatrixSpec], *, batched: bool = True
) -> OrthogonalizationPlan:
    """Group ``params`` into shape groups and assign each matrix an owner."""
    groups: dict[tuple, ShapeGroup] = {}
    for i, (p, spec) in enumerate(zip(params, specs, strict=True)):
        key = (tuple(p.shape), p.dtype, spec)
        group = groups.setdefault(key, ShapeGroup(tuple(p.shape), p.dtype, spec))
        group.indices.append(i)
    return OrthogonalizationPlan(list(groups.values()), batched)
