"""The rank-1 part of fp8 Muon momentum: a power step on (possibly sharded) momentum.

fp8 (e4m3) rounds every element to 3 mantissa bits, so its error is proportional to the
element. Muon momentum is dominated by a few directions, so MuonLP's fp8 format stores
``momentum = u w^T + fp8 residual``: one bf16 vector pair per matrix (``u`` along the rows,
``w`` along the columns; 2 bytes per row and per column, about 0.002 bytes per element of a
1024 x 4096 matrix) carries the leading direction and the fp8 codes only what is left, whose
elements are smaller. On the H200 ``bench_lp`` mlp task this took fp8 from +2.34% to about
+1.2% of fp32-state Muon (docs/performance.md).

``u w^T`` tracks the momentum's leading singular pair with one power-iteration step per
optimizer step, warm-started from the previous ``w``: ``u = normalize(M w_prev)``,
``w = M^T u``. The momentum moves slowly (it is an exponential average), so one step a step
keeps up.

Sharded parameters: the factors are laid out along the parameter's rows and columns (``u``
like the rows, sharded where the rows are and replicated where the columns are; ``w`` the
other way), so every rank holds exactly the slices its local block needs and a DCP checkpoint
reshards them like any DTensor. The power step sums over the sharded dimensions with one
``all_reduce`` per mesh dim that splits them (the matrix-vector product over column shards;
the norm and ``M^T u`` over row shards): two small collectives per parameter and step under
FSDP, or per stack of same-shape parameters when their steps run together. Leading (batch /
expert) dims are independent matrices and need none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from muon_plugin.lp.keys import U_KEY, W_KEY

FRESH_FACTORS = {U_KEY: 0.0, W_KEY: 1.0}
"""Factors of a zero momentum: ``u = 0`` (so ``u w^T = 0``) and ``w = 1``, the power
iteration's start vector."""


def factor_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Shapes of ``u`` and ``w`` for a momentum of ``shape`` (local or global)."""
    *lead, rows, cols = shape
    return {U_KEY: (*lead, rows), W_KEY: (*lead, cols)}


def factor_placements(p: DTensor, key: str) -> tuple[Placement, ...]:
    """Placements of factor ``key`` of DTensor parameter ``p``.

    The factor keeps the parameter's sharding of the leading dims and of its own dim (rows for
    ``u``, columns for ``w``, which becomes its last dim) and is replicated over mesh dims that
    split the other one.
    """
    ndim = p.ndim
    own = ndim - 2 if key == U_KEY else ndim - 1
    out: list[Placement] = []
    for placement in p.placements:
        dim = getattr(placement, "dim", None)
        if dim is None:
            out.append(placement)
            continue
        dim %= ndim
        if dim < ndim - 2:
            out.append(placement)  # a leading dim: the same dim of the factor
        elif dim == own:
            out.append(_with_dim(placement, ndim - 2))  # the factor's last dim
        else:
            out.append(Replicate())
    return tuple(out)


def _with_dim(placement: Shard, dim: int) -> Shard:
    """``placement`` (a Shard or a subclass such as FSDP2's strided shard) on another dim."""
    if type(placement) is Shard:
        return Shard(dim)
    clone = object.__new__(type(placement))
    clone.__dict__.update(placement.__dict__)
    object.__setattr__(clone, "dim", dim)
    return clone


def outer(u: Tensor, w: Tensor) -> Tensor:
    """``u w^T`` per matrix, in fp32: (*lead, rows) x (*lead, cols) -> (*lead, rows, cols)."""
    return u.float().unsqueeze(-1) * w.float().unsqueeze(-2)


def _sum_over_shards(t: Tensor, p: Tensor | None, param_dim: int) -> Tensor:
    """All-reduce ``t`` (in place) over the mesh dims that shard ``p`` along ``param_dim`` (none
    for a plain tensor or None)."""
    if isinstance(p, DTensor):
        for mesh_dim, placement in enumerate(p.placements):
            dim = getattr(placement, "dim", None)
            if dim is not None and dim % p.ndim == param_dim % p.ndim:
                dist.all_reduce(t, group=p.device_mesh.get_group(mesh_dim))
    return t


def _each(fn, stacked: bool, *args: Tensor) -> Tensor:
    """``fn(*args)``; with ``stacked``, ``fn`` on each entry of the leading (stack) dim, results
    stacked, so each entry rounds exactly as it would alone (a batched product or a long
    reduction may sum in another order)."""
    if not stacked:
        return fn(*args)
    return torch.stack([fn(*entry) for entry in zip(*args, strict=True)])


def _sum_last(t: Tensor) -> Tensor:
    return t.sum(-1, keepdim=True)


@torch.no_grad()
def power_step(
    m: Tensor, w_prev: Tensor, p: Tensor | None, stacked: bool = False
) -> tuple[Tensor, Tensor]:
    """One warm-started power-iteration step on the local block ``m`` (fp32) of ``p``'s momentum
    (``p``: the parameter, whose DTensor placements say which dims are sharded; None or a plain
    tensor: nothing is).

    Returns the local slices of ``u`` (unit norm per matrix) and ``w = M^T u`` in fp32. A matrix
    whose ``M w_prev`` is zero (a zero momentum, or an all-zero ``w_prev``) gets ``u = 0`` and
    ``w = 1``, so its next step starts the iteration afresh. With ``stacked``, ``m`` and
    ``w_prev`` carry a leading dim of same-shape parameters laid out like ``p``: each gets the
    result it would get alone, and the collectives run once for the whole stack.
    """
    y = _each(torch.matmul, stacked, m, w_prev.float().unsqueeze(-1)).squeeze(-1)  # (*lead, rows)
    _sum_over_shards(y, p, -1)
    norm = _sum_over_shards(_each(_sum_last, stacked, y.square()), p, -2).sqrt_()
    nonzero = norm > 0
    u = torch.where(nonzero, y / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    w = _each(torch.matmul, stacked, u.unsqueeze(-2), m).squeeze(-2)  # (*lead, cols)
    _sum_over_shards(w, p, -2)
    return u, torch.where(nonzero, w, 1.0)
