"""The Muon step as functions over lists of (local) tensors, in ``torch.optim``'s functional style.

Three stages, each over lists:

1. :func:`momentum_update_`: update the momentum buffers, return the directions;
2. :func:`orthogonalize`: hand the directions to a plan (:class:`Orthogonalizer`, built by
   :func:`muon_plugin.distributed.plan.plan_orthogonalization`), which assembles whole matrices
   from shards, orthogonalizes them and returns the local shards of the updates;
3. :func:`decay_and_update_`: decoupled (cautious) weight decay, then ``p -= lr * u`` (for a
   NorMuon parameter, ``u`` is the orthogonalized update times its rows' factors).

:func:`muon` runs the three for the Muon parameters of a step, group by group (one
:class:`GroupSettings` per group), all matrices through one plan. With ``foreach`` each group's
lists go to stages 1 and 3 at once; without it, as lists of one.

Contiguous CUDA tensors (fp32, bf16 or fp16) go through the grouped Triton kernels of
:mod:`muon_plugin.kernels.elementwise`: one launch and one pass over memory per same-dtype
sub-list, whatever the sizes (a list mixing bf16 and fp32 parameters makes two launches).
Everything else (CPU tensors, non-contiguous ones, other dtypes, or everything with
``MUON_PLUGIN_DISABLE_TRITON=1``) takes the ``torch._foreach_*`` ops below. The kernels follow
those ops step by step (ATen's lerp formulas, fp32 math, a rounding to the storage dtype where
each foreach op rounds, fused multiply-adds where ATen's CUDA kernels get them), so the two
paths agree to within about an ulp; the one difference is that the kernels return the direction
in bf16, the dtype the orthogonalization casts it to anyway. DTensors are handled by the caller,
which passes their local shards: stages 1 and 3 are elementwise, so shards need no
communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from muon_plugin.kernels.elementwise import (
    grouped_decay_update,
    grouped_momentum,
    kernel_groups,
)
from muon_plugin.orthogonalize.normuon import scale_rows


class Orthogonalizer(Protocol):
    """What stage 2 needs of a plan: local directions in, local updates out (same order).

    A plan whose specs normalize rows (NorMuon) also takes ``rows=``, the parameters' local
    per-row states, and ``factors=``, a list it fills with their rows' factors (see
    :meth:`muon_plugin.distributed.plan.OrthogonalizationPlan.run`)."""

    def run(self, directions: Sequence[Tensor]) -> list[Tensor]: ...


@dataclass(frozen=True)
class GroupSettings:
    """The elementwise settings of one param group, for ``size`` consecutive list entries."""

    size: int
    lr: float | Tensor
    weight_decay: float
    momentum: float
    nesterov: bool
    cautious: bool
    kernels: bool | None = None
    """Whether the grouped Triton elementwise kernels may run (the group's orthogonalization
    backend decides; None: wherever they can)."""


@dataclass(frozen=True)
class MomentumStorage:
    """How momentum is held: stage 1 on a chunk of the lists, and a copy and restore of one
    parameter's momentum for an update skipped as non-finite.

    The default, :data:`BUFFERS`, holds one tensor per parameter; MuonLP passes its own for
    quantized momentum (then ``momentum_buffers`` are its per-parameter states).
    """

    update_: Callable[[list[Tensor], list[Any], float, bool, bool | None], list[Tensor]]
    """``(grads, momentum_buffers, momentum, nesterov, kernels) -> directions``, updating in
    place (``kernels``: whether the Triton elementwise kernels may run)."""
    snapshot: Callable[[Any], Any]
    """A copy of one parameter's momentum."""
    restore_: Callable[[Any, Any, Tensor], None]
    """``(momentum, snapshot, finite)``: put the snapshot back where ``finite`` is False."""


def momentum_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Muon momentum is fp32 for bf16/fp16 parameters, else the parameter's own dtype."""
    return torch.float32 if param_dtype in (torch.bfloat16, torch.float16) else param_dtype


def momentum_update_(
    grads: list[Tensor],
    bufs: list[Tensor],
    momentum: float,
    nesterov: bool,
    kernels: bool | None = None,
) -> list[Tensor]:
    """Stage 1: update the momentum buffers in place and return the directions to orthogonalize.

    ``buf <- momentum * buf + (1 - momentum) * grad`` (``buf.lerp_(grad, 1 - momentum)``); the
    direction is the Nesterov look-ahead ``grad + momentum * (buf - grad)`` or ``buf`` itself.
    Gradients are cast to the buffers' dtype (fp32 for bf16/fp16 parameters) first. On the
    kernel path the direction is a new bf16 tensor; on the foreach path it is in the buffers'
    dtype (without Nesterov: the buffer itself).
    """
    groups, rest = kernel_groups(grads, bufs, enabled=kernels)
    out: list[Tensor | None] = [None] * len(grads)
    for idx in groups:
        directions = grouped_momentum(
            [grads[i] for i in idx], [bufs[i] for i in idx], momentum, nesterov
        )
        for i, d in zip(idx, directions, strict=True):
            out[i] = d
    if rest:
        bs = [bufs[i] for i in rest]
        gs = [
            grads[i] if grads[i].dtype == bufs[i].dtype else grads[i].to(bufs[i].dtype)
            for i in rest
        ]
        torch._foreach_lerp_(bs, gs, 1.0 - momentum)
        directions = torch._foreach_lerp(gs, bs, momentum) if nesterov else bs
        for i, d in zip(rest, directions, strict=True):
            out[i] = d
    return out  # type: ignore[return-value]


def orthogonalize(
    directions: Sequence[Tensor],
    plan: Orthogonalizer,
    rows: Sequence[Tensor | None] | None = None,
    factors: list[Tensor | None] | None = None,
) -> list[Tensor]:
    """Stage 2: the local shards of the orthogonalized, lr-shape-scaled updates.

    The plan owns the matrices' assembly from shards, their orthogonalization, the lr shape
    factor and, for specs that ask for it, NorMuon's row normalization with the per-row states
    ``rows`` (updated in place), whose rows' factors it puts into ``factors``;
    ``directions`` must be in the order the plan was built for.
    """
    if rows is None:
        return plan.run(directions)
    return plan.run(directions, rows=rows, factors=factors)  # type: ignore[call-arg]


def decay_and_update_(
    params: list[Tensor],
    updates: list[Tensor],
    lr: float | Tensor,
    weight_decay: float,
    cautious: bool,
    kernels: bool | None = None,
    factors: Sequence[Tensor] | None = None,
) -> None:
    """Stage 3: decay ``p`` by ``lr*wd`` (only where update and ``p`` agree in sign if
    cautious), then ``p -= lr * u``.

    Weight decay is decoupled and uses the group ``lr``; any shape-dependent learning-rate
    factor is already folded into ``updates``. With ``factors`` (NorMuon: per parameter, its
    local rows' factors, fp32), ``u`` is ``update * factor`` row by row, in fp32. Every op
    rounds to the parameter dtype, on both paths.
    """
    if factors is not None and len(factors) != len(params):
        raise ValueError(f"{len(factors)} row factors for {len(params)} parameters")
    groups, rest = kernel_groups(params, updates, enabled=kernels)
    for idx in groups:
        grouped_decay_update(
            [params[i] for i in idx],
            [updates[i] for i in idx],
            lr,
            weight_decay,
            cautious,
            None if factors is None else [factors[i] for i in idx],
        )
    if not rest:
        return
    ps = [params[i] for i in rest]
    if factors is None:
        us = [updates[i] for i in rest]
    else:
        us = [scale_rows(updates[i], factors[i]) for i in rest]
    if weight_decay != 0.0 and lr != 0.0:
        if cautious:
            agree = torch._foreach_mul(us, ps)
            torch._foreach_sign_(agree)
            torch._foreach_clamp_min_(agree, 0.0)  # 1 where update and param agree, else 0
            torch._foreach_addcmul_(ps, ps, agree, value=-lr * weight_decay)
        else:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_add_(ps, us, alpha=-lr)


def nonfinite_updates(updates: Sequence[Tensor]) -> dict[int, Tensor]:
    """The positions of the non-finite updates, each with its ``isfinite`` mask.

    Newton-Schulz turns any NaN/Inf in a matrix (or row block) into an all-non-finite result,
    and every rank receives its shard of that result, so the mask selects whole matrices, the
    same ones on every rank. One device-to-host copy (the per-update flags).
    """
    if not updates:
        return {}
    norms = torch._foreach_norm(list(updates))
    finite = torch.stack([n.float() for n in norms]).isfinite().tolist()
    return {k: torch.isfinite(updates[k]) for k, ok in enumerate(finite) if not ok}


def _restore_buffer_(buf: Tensor, before: Tensor, finite: Tensor) -> None:
    buf.copy_(torch.where(finite, buf, before))


BUFFERS = MomentumStorage(momentum_update_, Tensor.clone, _restore_buffer_)
"""Momentum as one buffer per parameter (fp32 for bf16/fp16 parameters)."""


def group_chunks(
    groups: Sequence[GroupSettings], foreach: bool
) -> list[tuple[GroupSettings, range]]:
    """Each group with the index ranges stages 1 and 3 run on: the whole group at once
    (``foreach``), or one entry at a time."""
    out, start = [], 0
    for group in groups:
        end = start + group.size
        if foreach:
            out.append((group, range(start, end)))
        else:
            out += [(group, range(i, i + 1)) for i in range(start, end)]
        start = end
    return out


def muon(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Any],
    groups: Sequence[GroupSettings],
    plan: Orthogonalizer,
    *,
    foreach: bool = True,
    skip_nonfinite: bool = False,
    storage: MomentumStorage = BUFFERS,
    second_moments: Sequence[Tensor | None] | None = None,
) -> list[int]:
    """One Muon step for lists of local tensors; returns the positions of skipped updates.

    ``params``, ``grads`` and ``momentum_buffers`` are aligned, group after group as
    ``groups`` count them; ``plan`` was built for ``params`` in this order. With
    ``skip_nonfinite``, a parameter whose update is non-finite keeps its weights and momentum
    where the update is non-finite (whole matrices or row blocks, see
    :func:`nonfinite_updates`). ``second_moments``: per parameter, its local NorMuon per-row
    state (fp32) when its group normalizes rows, else None (all None: omit it); with
    ``skip_nonfinite`` a state left non-finite by a skipped update is restored too.

    A plan with several ``phases`` (sets of parameter positions whose matrices need no
    communication) is run phase by phase, each through all three stages, so that only one
    phase's directions, stacks and updates are alive at a time; the results are the same as in
    one pass (every matrix is orthogonalized alone or in the same stack either way).
    """
    chunks = group_chunks(groups, foreach)
    phases: list[Sequence[int]] = list(getattr(plan, "phases", None) or [range(len(params))])
    skipped: list[int] = []
    for k, phase in enumerate(phases):
        members = set(phase)
        sub = [(g, [i for i in idx if i in members]) for g, idx in chunks]
        step = _Step(params, grads, momentum_buffers, storage, skip_nonfinite, second_moments)
        skipped += step.run([(g, ix) for g, ix in sub if ix], plan, k if len(phases) > 1 else None)
    return sorted(skipped)


@dataclass
class _Step:
    """The three stages on some of a step's parameters (one phase of its plan)."""

    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    momentum_buffers: Sequence[Any]
    storage: MomentumStorage
    skip_nonfinite: bool
    rows: Sequence[Tensor | None] | None = None

    def run(
        self, chunks: list[tuple[GroupSettings, list[int]]], plan: Orthogonalizer, phase: int | None
    ) -> list[int]:
        """Stages 1-3 for the positions of ``chunks``; the positions whose update was skipped."""
        params, bufs, storage = self.params, self.momentum_buffers, self.storage
        order = [i for _, idx in chunks for i in idx]
        saved = {i: storage.snapshot(bufs[i]) for i in order} if self.skip_nonfinite else {}
        rows = self.rows
        saved_rows = (
            {i: rows[i].clone() for i in order if rows[i] is not None}  # type: ignore[union-attr]
            if self.skip_nonfinite and rows is not None
            else {}
        )
        directions: list[Tensor | None] = [None] * len(params)
        for group, idx in chunks:
            out = storage.update_(
                [self.grads[i] for i in idx],
                [bufs[i] for i in idx],
                group.momentum,
                group.nesterov,
                group.kernels,
            )
            for i, d in zip(idx, out, strict=True):
                directions[i] = d
        factors: list[Tensor | None] = [None] * len(params)
        if phase is None:
            updates = orthogonalize(directions, plan, rows, factors)  # type: ignore[arg-type]
        elif rows is None:
            updates = plan.run(directions, phase)  # type: ignore[call-arg]
        else:
            updates = plan.run(directions, phase, rows=rows, factors=factors)  # type: ignore[call-arg]
        del directions
        bad = nonfinite_updates([updates[i] for i in order]) if self.skip_nonfinite else {}
        skipped = {order[j]: finite for j, finite in bad.items()}
        before = {}
        for i, finite in skipped.items():
            storage.restore_(bufs[i], saved[i], finite)
            before[i] = params[i].clone()
        for i, state in saved_rows.items():
            # Non-finite rows come from a skipped matrix (also on a rank whose shard of it is
            # empty, which sees no update to skip).
            row = rows[i]  # type: ignore[index]
            row.copy_(torch.where(torch.isfinite(row), row, state))
        for group, idx in chunks:
            row_factors = [factors[i] for i in idx]
            decay_and_update_(
                [params[i] for i in idx],
                [updates[i] for i in idx],
                group.lr,
                group.weight_decay,
                group.cautious,
                group.kernels,
                None if row_factors[0] is None else row_factors,  # type: ignore[arg-type]
            )
        for i, finite in skipped.items():
            params[i].copy_(torch.where(finite, params[i], before[i]))
        return list(skipped)
