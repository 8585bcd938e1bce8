"""The rescale: multiply each local row of each described parameter by its head's factor.

Head ``h`` owns contiguous rows (dim 0) of ``wq`` / ``wk`` / a fused ``wqkv`` / MLA's ``wq_b``
and ``wkv_b``, so scaling a head is a per-row multiply, local on any dim-0 shard: FSDP2's
``Shard(0)``, tensor parallelism's column shards, FSDP x TP's ``_StridedShard`` + ``Shard``,
HSDP replicas, uneven shards, plain tensors. :func:`plan_rows` finds, once, which global rows
this rank holds (:func:`muon_plugin.distributed.layout.layout_of`, no communication) and the
factor index of each; :meth:`RowPlan.apply` is then one gather and one in-place multiply per
parameter (and per registered copy of it: an fp32 master or a low-precision copy laid out
like the local shard). Rows of no head (values, a shared rope key, what a fused weight holds
besides q and k) get the factor 1.0, which leaves them bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.distributed.layout import LayoutError, layout_of, local
from muon_plugin.qk_clip.heads import AttentionHeads

__all__ = ["HeadRange", "RowPlan", "held_rows", "plan_rows"]


@dataclass(frozen=True)
class HeadRange:
    """The heads of one layer whose statistic this rank records and whose rows it may hold:
    query heads ``[q_start, q_start + n_q)``, key heads ``[k_start, k_start + n_kv)``."""

    q_start: int
    n_q: int
    k_start: int
    n_kv: int


def held_rows(param: Tensor) -> list[tuple[int, int]]:
    """The global dim-0 rows this rank holds of ``param``, as runs ``[start, stop)`` in local
    order (all rows for a plain tensor; none when this rank is outside the DTensor's mesh)."""
    if not isinstance(param, DTensor):
        return [(0, param.shape[0])]
    mesh = param.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return []
    layout = layout_of(tuple(param.shape), tuple(mesh.shape), tuple(param.placements))
    return list(layout.index[0][layout.linear(tuple(coord))].runs)


@dataclass
class RowPlan:
    """One parameter's local rows and the factor index of each."""

    name: str
    param: Tensor
    index: Tensor
    """Per local row, its index in the factor vector."""
    copies: list[Tensor] = field(default_factory=list)
    """Tensors laid out like the local shard that take the same factors (fp32 masters,
    low-precision copies)."""

    def apply(self, factors: Tensor) -> None:
        """Multiply the local rows (and the copies) by their factors, in place, no autograd."""
        with torch.no_grad():
            targets = [local(self.param), *self.copies]
            row = factors[self.index]
            for t in targets:
                r = row.to(device=t.device, dtype=t.dtype)  # no-op when they agree
                t.mul_(r.view(-1, *([1] * (t.dim() - 1))))


def plan_rows(
    layers: Sequence[AttentionHeads],
    ranges: Sequence[HeadRange],
    slot: Callable[[int, str, int], int],
    one_slot: int,
    device: torch.device,
    copies: dict[int, list[Tensor]] | None = None,
) -> list[RowPlan]:
    """A :class:`RowPlan` per parameter of ``layers`` holding at least one local row.

    ``slot(layer, part, local_head)``: the factor index of a local head's part;
    ``one_slot``: the index of the factor 1.0. ``copies``: ``id(param) -> tensors`` laid out
    like its local shard. Raises ValueError naming the parameter when a held row belongs to a
    head outside this rank's range (heads and rows split differently, e.g. a sharding that
    pairs heads with another rank's rows), or when a parameter appears in two layers.
    """
    copies = copies or {}
    plans: list[RowPlan] = []
    owner: dict[int, str] = {}
    for li, (heads, hr) in enumerate(zip(layers, ranges, strict=True)):
        for name, param in heads.params():
            if id(param) in owner:
                raise ValueError(
                    f"QK-Clip: parameter {name!r} is described by two attention layers "
                    f"({owner[id(param)]!r} and {heads.name!r})"
                )
            owner[id(param)] = heads.name
            try:
                runs = held_rows(param)
            except LayoutError as e:
                raise ValueError(f"QK-Clip: parameter {name!r}: {e}") from e
            n_local = sum(b - a for a, b in runs)
            if n_local == 0:
                continue
            row_slot = torch.full((param.shape[0],), one_slot, dtype=torch.long)
            for blk in heads.blocks:
                if blk.param is not param:
                    continue
                first, count = (hr.k_start, hr.n_kv) if blk.part == "k" else (hr.q_start, hr.n_q)
                row_slot[blk.start : blk.start + blk.rows] = -1 - blk.head  # resolved below
                if first <= blk.head < first + count:
                    row_slot[blk.start : blk.start + blk.rows] = slot(
                        li, blk.part, blk.head - first
                    )
            held = torch.cat([torch.arange(a, b) for a, b in runs])
            index = row_slot[held]
            foreign = (index < 0).nonzero()
            if foreign.numel():
                row = int(held[foreign[0, 0]])
                raise ValueError(
                    f"QK-Clip: parameter {name!r} of {heads.name!r}: this rank holds row {row}, "
                    f"of head {-1 - int(index[foreign[0, 0]])}, which is not among its heads "
                    f"(query heads {hr.q_start}..{hr.q_start + hr.n_q - 1}); the sharding "
                    "splits rows and heads differently"
                )
            local_shape = local(param).shape
            extra = copies.get(id(param), [])
            for c in extra:
                if c.shape != local_shape:
                    raise ValueError(
                        f"QK-Clip: a copy of {name!r} has shape {tuple(c.shape)}, its local "
                        f"shard {tuple(local_shape)}"
                    )
            plans.append(RowPlan(name, param, index.to(device), list(extra)))
    return plans
