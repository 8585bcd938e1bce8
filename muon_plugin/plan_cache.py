"""The optimizer's orthogonalization plan: built once, reused while the step's parameters are
the same, and checked against the other ranks' at every step.

A plan (:mod:`muon_plugin.distributed.plan`) is built for one list of Muon parameters with
gradients, their layouts and specs; :class:`PlanCache` keeps it and its agreement (what the
ranks of each mesh must give identically) under a key of those, and rebuilds both only when
the key changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.distributed.plan import OrthogonalizationPlan, PreparedPlan, prepare_plan
from muon_plugin.group_settings import agreed_settings
from muon_plugin.orthogonalize import MatrixSpec
from muon_plugin.parameters import names_by_id


class PlanCache:
    """The plan of the last step's Muon parameters (``plan``: None before the first step and
    after a change), and their checked, placed description (``prepared``)."""

    def __init__(self) -> None:
        self.plan: OrthogonalizationPlan | None = None
        self.prepared: PreparedPlan | None = None
        self._key: tuple | None = None

    def get(
        self,
        params: list[Tensor],
        specs: list[MatrixSpec],
        param_groups: Sequence[Mapping[str, Any]],
        *,
        batched: bool,
        replicate_group: Any,
    ) -> OrthogonalizationPlan:
        """The plan for this set of parameters, layouts and specs (rebuilt on change).

        The ranks of every mesh check at every step that they give the same parameters
        (:mod:`~muon_plugin.distributed.agreement`), before any of them rebuilds: a gradient
        that is None on some ranks only ends on every rank in an error naming the parameter.
        ``param_groups`` name the parameters and carry the settings the ranks must share.
        """
        key = tuple(
            (id(p), p.shape, p.placements if isinstance(p, DTensor) else None, spec)
            for p, spec in zip(params, specs, strict=True)
        )
        if key != self._key:
            # Names and settings, which the ranks of a mesh must agree on.
            names = names_by_id(param_groups)
            settings = {id(p): agreed_settings(g) for g in param_groups for p in g["params"]}
            self.prepared = prepare_plan(
                params,
                specs,
                batched=batched,
                names=[names[id(p)] for p in params],
                replicate_group=replicate_group,
                settings=[settings[id(p)] for p in params],
            )
            self.plan, self._key = None, key
        assert self.prepared is not None
        self.prepared.agreement.verify()
        if self.plan is None:
            self.plan = self.prepared.build()
        return self.plan
