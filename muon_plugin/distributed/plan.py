"""Which rank orthogonalizes which whole matrix, and how the shards reach it and come back.

A plan is built once per set of parameters (the optimizer caches it) and executed every step.
It is put together from three parts:

- the **planner** (:mod:`~muon_plugin.distributed.planner`, with
  :mod:`~muon_plugin.distributed.schedule`): pure, every rank computes the same shape groups,
  units, owners, schedules, per-rank traffic and FLOPs, and resolves each group's
  orthogonalization path once (its spec's backend);
- the **communicator** (:mod:`~muon_plugin.distributed.communicator`): the process groups,
  created after planning, the wire buffers and the all-to-alls, with byte/collective stats;
- the **executor** (:mod:`~muon_plugin.distributed.executor`): per step, gather ->
  orthogonalize on the resolved path -> return.

:func:`simulate_plan` is the planner alone (hypothetical parameters, no processes): a plan
that reports like a real one but cannot ``run``. Input validation (layouts the plan cannot
handle) is in :mod:`~muon_plugin.distributed.validation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from muon_plugin.distributed.agreement import Agreement
from muon_plugin.distributed.communicator import Communicator
from muon_plugin.distributed.executor import Executor
from muon_plugin.distributed.groups import group_domain
from muon_plugin.distributed.layout import local
from muon_plugin.distributed.planner import (
    ParamLayout,
    ShapeGroup,
    local_phases,
    plan_groups,
    simulated_layouts,
)
from muon_plugin.distributed.report import report_rows
from muon_plugin.distributed.schedule import WIRE_BYTES, WIRE_DTYPE, Schedule
from muon_plugin.distributed.validation import place
from muon_plugin.orthogonalize import MatrixSpec, validate_backend

__all__ = [
    "WIRE_BYTES",
    "WIRE_DTYPE",
    "OrthogonalizationPlan",
    "PreparedPlan",
    "Schedule",
    "ShapeGroup",
    "plan_orthogonalization",
    "prepare_plan",
    "simulate_plan",
]


class OrthogonalizationPlan:
    """A cached assignment of whole matrices to ranks; ``run`` maps directions to updates.

    Built by :func:`plan_orthogonalization` (or, not runnable, by :func:`simulate_plan`).
    ``last_stats`` holds this rank's bytes sent/received and collective calls of the last run.
    """

    def __init__(
        self,
        groups: list[ShapeGroup],
        batched: bool,
        communicator: Communicator | None = None,
    ) -> None:
        self.groups = groups
        self.executor = None if communicator is None else Executor(groups, communicator, batched)
        self.last_stats: dict[str, int] = {}
        self._phase_groups = local_phases(groups)
        self.phases: list[list[int]] = [
            sorted(i for g in phase for i in g.indices) for phase in self._phase_groups
        ]
        """Parameter positions a step may take through all three stages one set after another
        (bounding the step's workspace): several sets only where no group communicates."""

    def run(
        self,
        directions: Sequence[Tensor | None],
        phase: int | None = None,
        rows: Sequence[Tensor | None] | None = None,
        factors: list[Tensor | None] | None = None,
    ) -> list[Any]:
        """Orthogonalize ``directions`` (local shards laid out as their parameters).

        Returns, per parameter, the local shard (same shape as the input) of the orthogonalized
        whole matrix, in bf16. Every rank of every domain must call this with the same plan.
        With ``phase``, only the parameters of ``phases[phase]`` (their directions are read,
        the other entries may be None, and come back None). ``rows``: the local per-row states
        (fp32) of the parameters whose spec normalizes rows (NorMuon), updated in place; None
        for the others. ``factors`` (a list as long as ``directions``, needed with ``rows``)
        receives those parameters' rows' factors: their update is the returned shard times
        its rows' factors.
        """
        if self.executor is None:
            raise RuntimeError("a simulated plan (simulate_plan) reports but cannot run")
        groups = None if phase is None else self._phase_groups[phase]
        out = self.executor.run(directions, groups, rows, factors)
        self.last_stats = dict(self.executor.comm.stats)
        return out

    def report(self) -> list[dict[str, Any]]:
        """Per shape group: layout, matrices, matrices/bytes/FLOPs per rank, backend and path
        (see :func:`~muon_plugin.distributed.report.report_rows`)."""
        return report_rows(self.groups)


@dataclass(frozen=True)
class PreparedPlan:
    """A plan's inputs, checked and placed on this rank, and what the ranks must agree on:
    everything but the collectives (:func:`prepare_plan`)."""

    layouts: list[ParamLayout]
    agreement: Agreement
    """Verify it (a collective) before :meth:`build`, on every rank."""
    batched: bool

    def build(self) -> OrthogonalizationPlan:
        """The plan (its process groups are created here: a collective on first use)."""
        groups = plan_groups(self.layouts, batched=self.batched)
        return OrthogonalizationPlan(groups, self.batched, Communicator(groups))


def prepare_plan(
    params: Sequence[Tensor],
    specs: Sequence[MatrixSpec],
    *,
    batched: bool = True,
    names: Sequence[str] | None = None,
    replicate_group: ProcessGroup | Any | None = None,
    settings: Sequence[Any] | None = None,
) -> PreparedPlan:
    """Check and place ``params`` and describe what the ranks must agree on, without any
    collective. Arguments and errors as :func:`plan_orthogonalization` (but the ranks'
    disagreement, which only ``agreement.verify()`` finds)."""
    params, specs = list(params), list(specs)
    if len(params) != len(specs):
        raise ValueError(f"{len(params)} params but {len(specs)} specs")
    for spec in set(specs):  # before any collective: every rank refuses the same specs
        validate_backend(spec.backend)
    names = list(names) if names is not None else [f"#{i}" for i in range(len(params))]
    replicate_domain = None
    if replicate_group is not None:
        replicate_domain = group_domain(replicate_group)
        if replicate_domain.size == 1:
            replicate_domain = None
    placed = [place(p, names[i], replicate_domain) for i, p in enumerate(params)]
    extra = [None] * len(params) if settings is None else list(settings)
    agreement = Agreement(
        params,
        names,
        [domain for domain, _ in placed],
        [(spec, more) for spec, more in zip(specs, extra, strict=True)],
        {"batched": batched},
    )
    layouts = [
        ParamLayout(names[i], tuple(p.shape), p.dtype, domain, layout, local(p).device, specs[i])
        for i, (p, (domain, layout)) in enumerate(zip(params, placed, strict=True))
    ]
    return PreparedPlan(layouts, agreement, batched)


def plan_orthogonalization(
    params: Sequence[Tensor],
    specs: Sequence[MatrixSpec],
    *,
    batched: bool = True,
    names: Sequence[str] | None = None,
    replicate_group: ProcessGroup | Any | None = None,
    settings: Sequence[Any] | None = None,
) -> OrthogonalizationPlan:
    """Group ``params`` into shape groups, give every matrix one owner, schedule the traffic.

    Args:
        params: the Muon parameters of a step (DTensors or plain tensors), in the same order on
            every rank.
        specs: their orthogonalization specs (``spec.backend`` picks the backend).
        batched: orthogonalize the matrices a rank owns in one stacked call per shape group.
        names: parameter names for error messages.
        replicate_group: process group (or 1-D mesh) over which *plain* tensors are replicated
            (DDP): their matrices are then split over its ranks and the results all-gathered.
            Without it plain tensors are orthogonalized where they are.
        settings: per parameter, further settings the ranks of its mesh must agree on (the
            group's math settings).

    Raises:
        ValueError naming the parameter and its placements when a layout cannot be handled
        (Partial or unknown placements, a mesh this rank is not part of, a local shard that is
        not where the placements say), or naming ``backend`` for an unknown backend.
        RankDisagreementError (a ValueError) on every rank of a mesh whose ranks passed other
        parameters, placements or settings (:mod:`~muon_plugin.distributed.agreement`).
    """
    prepared = prepare_plan(
        params, specs, batched=batched, names=names, replicate_group=replicate_group,
        settings=settings,
    )  # fmt: skip
    prepared.agreement.verify()
    return prepared.build()


def simulate_plan(
    entries: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...], MatrixSpec]],
    *,
    rank: int = 0,
    dtype: torch.dtype = torch.float32,
    batched: bool = True,
    device: torch.device | str = "cpu",
) -> OrthogonalizationPlan:
    """The plan for hypothetical parameters, without processes (for reports and benchmarks).

    ``entries`` are ``(global shape, mesh shape, placements, spec)``; every mesh spans ranks
    ``0 .. N-1`` in row-major order and ``rank`` is the process whose schedule (and paths, for
    ``device``) is built. The plan reports like a real one but cannot ``run``.
    """
    layouts = simulated_layouts(entries, rank=rank, dtype=dtype, device=device)
    return OrthogonalizationPlan(plan_groups(layouts, batched=batched), batched)
