"""Distributed orthogonalization: plans that give each whole matrix to exactly one rank."""

from muon_plugin.distributed.agreement import RankDisagreementError
from muon_plugin.distributed.plan import OrthogonalizationPlan, plan_orthogonalization

__all__ = ["OrthogonalizationPlan", "RankDisagreementError", "plan_orthogonalization"]
