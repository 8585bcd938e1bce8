"""Where every rank's local shard of a DTensor sits in the global tensor, without communication.

A DTensor's local shard is an outer product of per-dimension index lists: along tensor dim ``d``
a rank holds the global indices ``I_d`` (sorted), and its local tensor is ``full[I_0, I_1, ...]``.
:func:`layout_of` computes those lists for every coordinate of the mesh from the shape, the mesh
shape and the placements alone, so every rank knows every other rank's shard.

Semantics (checked against ``DTensor.full_tensor()`` of real ``fully_shard`` and
``parallelize_module`` parameters in ``tests/distributed/test_distributed.py``):

- ``Shard(d)`` cuts dim ``d`` like ``torch.chunk`` (chunk size ``ceil(n / k)``, so trailing
  ranks may hold fewer rows or none); the cut is ``torch``'s own ``Shard._split_tensor``
  (``with_padding=False``) applied to ``arange``.
- Several mesh dims sharding the same tensor dim apply in *shard order*: left to right for plain
  ``Shard``; ``_StridedShard(d, split_factor=sf)`` says that mesh dims worth ``sf`` shards to its
  right cut the dim *before* it does (FSDP2 over TP: ``(_StridedShard(0, sf=tp), Shard(0))``
  means "TP cuts first, FSDP cuts each TP shard"). The decoding follows
  ``DTensorSpec._maybe_convert_StridedShard_to_shard_order``. Note that
  ``_StridedShard._split_tensor`` (used by ``distribute_tensor``) disagrees with this (and with
  ``full_tensor()`` and FSDP2's real layout) for some uneven sizes, e.g. 7 rows on a 3 x 2 mesh,
  which is why it is not used here.
- ``Replicate`` mesh dims duplicate the data. ``Partial`` and unknown placements are refused.

Index lists are stored as sorted runs ``((start, stop), ...)``: one run for a plain shard, a few
for strided ones; copying a piece of a matrix is then a handful of rectangular slice copies.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

Runs = tuple[tuple[int, int], ...]


class LayoutError(ValueError):
    """A layout the planner cannot map (the caller adds the parameter's name)."""


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class DimIndex:
    """The sorted global indices one rank holds along one tensor dim, as runs ``[start, stop)``."""

    runs: Runs

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.runs)

    def position(self, index: int) -> int | None:
        """Local position of global ``index``, or None when this rank does not hold it."""
        offset = 0
        for a, b in self.runs:
            if a <= index < b:
                return offset + index - a
            offset += b - a
        return None

    def local_runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(global_start, local_start, length)`` of every run."""
        out = []
        offset = 0
        for a, b in self.runs:
            out.append((a, offset, b - a))
            offset += b - a
        return tuple(out)


def runs_of(indices: torch.Tensor) -> Runs:
    """Maximal runs of consecutive integers in a sorted 1-D index tensor."""
    if indices.numel() == 0:
        return ()
    values = indices.tolist()
    runs = []
    start = prev = values[0]
    for v in values[1:]:
        if v != prev + 1:
            runs.append((start, prev + 1))
            start = v
        prev = v
    runs.append((start, prev + 1))
    return tuple(runs)


def describe_placements(placements: tuple[Placement, ...]) -> str:
    """Short text for placements: ``(_S(0,2),S(0))``, ``(R,S(0))``."""
    parts = []
    for p in placements:
        if type(p) is Replicate:
            parts.append("R")
        elif type(p) is _StridedShard:
            parts.append(f"_S({p.dim},{p.split_factor})")
        elif type(p) is Shard:
            parts.append(f"S({p.dim})")
        else:
            parts.append(str(p))
    return "(" + ",".join(parts) + ")"


def normalize_placements(
    placements: tuple[Placement, ...], ndim: int, mesh_shape: tuple[int, ...]
) -> tuple[Placement, ...]:
    """Placements with non-negative dims; LayoutError for anything not Shard/_StridedShard/
    Replicate (Partial, custom placements) or not matching the mesh."""
    if len(placements) != len(mesh_shape):
        raise LayoutError(
            f"{len(placements)} placements for a {len(mesh_shape)}-D mesh {mesh_shape}"
        )
    out: list[Placement] = []
    for p in placements:
        kind = type(p)
        if kind is Replicate:
            out.append(p)
        elif kind in (Shard, _StridedShard):
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise LayoutError(f"placement {p} shards dim {p.dim} of a {ndim}-D tensor")
            if kind is Shard:
                out.append(Shard(dim))
            else:
                out.append(_StridedShard(dim, split_factor=int(p.split_factor)))
        else:
            why = (
                "a Partial (pending-reduction) value is not a shard of the matrix"
                if "Partial" in kind.__name__
                else "the planner does not know this placement type"
            )
            raise LayoutError(f"unsupported placement {p!r}: {why}")
    return tuple(out)


def shard_order(
    placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], ndim: int
) -> tuple[tuple[int, ...], ...]:
    """Per tensor dim, the mesh dims that cut it, in the order they cut it.

    Plain ``Shard`` placements cut left to right. A ``_StridedShard`` with split factor ``sf``
    is inserted where the mesh dims already placed before it multiply to ``sf`` (processing the
    mesh dims right to left), which is how ``_StridedShard`` records a right-to-left order.
    """
    orders: list[list[int]] = [[] for _ in range(ndim)]
    for mesh_dim in reversed(range(len(placements))):
        p = placements[mesh_dim]
        if type(p) is Replicate:
            continue
        order = orders[p.dim]
        sf = int(p.split_factor) if type(p) is _StridedShard else 1
        accumulated = 1
        for i in range(len(order) + 1):
            if accumulated == sf:
                order.insert(i, mesh_dim)
                break
            if i < len(order):
                accumulated *= mesh_shape[order[i]]
        else:
            raise LayoutError(
                f"placements {describe_placements(placements)} on mesh {mesh_shape}: "
                f"split factor {sf} of mesh dim {mesh_dim} matches no shard order"
            )
    return tuple(tuple(o) for o in orders)


def chunk(indices: torch.Tensor, num_chunks: int, i: int) -> torch.Tensor:
    """Chunk ``i`` of ``num_chunks`` of a 1-D tensor, with ``Shard``'s own split semantics."""
    return chunks(indices, num_chunks)[i]


def chunks(indices: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """All ``num_chunks`` chunks of a 1-D tensor (trailing ones may be empty), cut by
    ``Shard``'s own split (``with_padding=False``)."""
    pieces, _ = Shard(0)._split_tensor(indices, num_chunks, with_padding=False, contiguous=False)
    return pieces


def _cut(
    indices: torch.Tensor, order: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> dict[tuple[int, ...], DimIndex]:
    """The :class:`DimIndex` of every coordinate key (the coordinates on the mesh dims of
    ``order``, in that order) when those mesh dims cut ``indices`` one after another. Each
    (sub)range is split once into all of its chunks, so a mesh of N ranks costs O(N) splits."""
    if not order:
        return {(): DimIndex(runs_of(indices))}
    out: dict[tuple[int, ...], DimIndex] = {}
    for c, piece in enumerate(chunks(indices, mesh_shape[order[0]])):
        for rest, index in _cut(piece, order[1:], mesh_shape).items():
            out[(c, *rest)] = index
    return out


@dataclass(frozen=True)
class Layout:
    """Shape, mesh shape and placements of a tensor, and the index lists of every mesh rank.

    Ranks are numbered by their *linear* index: the row-major position of their coordinate in
    the mesh (``mesh.mesh.flatten()`` order). ``index[d][j]`` is the :class:`DimIndex` of
    tensor dim ``d`` on linear rank ``j``.
    """

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    index: tuple[tuple[DimIndex, ...], ...]

    @property
    def num_ranks(self) -> int:
        return math.prod(self.mesh_shape)

    def local_shape(self, j: int) -> tuple[int, ...]:
        return tuple(self.index[d][j].size for d in range(len(self.shape)))

    def coordinate(self, j: int) -> tuple[int, ...]:
        coord = []
        for size in reversed(self.mesh_shape):
            coord.append(j % size)
            j //= size
        return tuple(reversed(coord))

    def linear(self, coord: tuple[int, ...]) -> int:
        j = 0
        for c, size in zip(coord, self.mesh_shape, strict=True):
            j = j * size + c
        return j

    @property
    def replicate_mesh_dims(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.placements) if type(p) is Replicate)

    def sender_for(self, j: int, owner: int) -> int:
        """The rank holding ``j``'s shard whose coordinates on Replicate mesh dims are ``owner``'s
        (exactly one replica of each shard sends it; owners on different replicas spread the
        sending across replicas)."""
        coord = list(self.coordinate(j))
        owner_coord = self.coordinate(owner)
        for m in self.replicate_mesh_dims:
            coord[m] = owner_coord[m]
        return self.linear(tuple(coord))


def row_placements(placements: tuple[Placement, ...], row_dims: int) -> tuple[Placement, ...]:
    """The placements of a parameter's per-row state (one entry per row of each matrix: the
    parameter's first ``row_dims`` dims): the parameter's, with the mesh dims that cut a later
    (column) dim replicated, since every rank holding part of a row holds that row's state."""
    return tuple(p if type(p) is Replicate or p.dim < row_dims else Replicate() for p in placements)


@cache
def layout_of(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> Layout:
    """The :class:`Layout` of a tensor of global ``shape`` placed on a mesh of ``mesh_shape``.

    Cached per (shape, mesh shape, placements). Raises LayoutError for unsupported placements.
    """
    ndim = len(shape)
    placements = normalize_placements(tuple(placements), ndim, tuple(mesh_shape))
    orders = shard_order(placements, tuple(mesh_shape), ndim)
    num_ranks = math.prod(mesh_shape)
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    index: list[tuple[DimIndex, ...]] = []
    for d in range(ndim):
        order = orders[d]
        by_key = _cut(torch.arange(shape[d]), order, tuple(mesh_shape))
        index.append(tuple(by_key[tuple(coords[j][m] for m in order)] for j in range(num_ranks)))
    return Layout(tuple(shape), tuple(mesh_shape), placements, tuple(index))
