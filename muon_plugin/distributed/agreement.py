"""Do the ranks of each device mesh agree on the parameters a plan orthogonalizes?

Every rank builds its plan from its own parameter list. When the ranks of a mesh list different
parameters (another set with gradients, another order, another shape, placement, dtype or
setting), the plans still line up whenever the sizes happen to match, and matrices get assembled
from the shards of other matrices: silently wrong updates; or they do not, and the all-to-alls
wait until the collective timeout. So the ranks of every multi-rank domain (the ranks of a
device mesh, or of the group plain tensors are replicated over) compare their lists:

1. :class:`Agreement` (no collective) hashes each rank's description of a domain's parameters
   (name, global shape, dtype, mesh, placements and settings, in order) and the plan settings
   into a fixed-size digest; the optimizer keeps it with its cached plan;
2. :meth:`Agreement.verify` (a collective) reduces the digests over a process group spanning
   exactly the domain's ranks: one all-reduce of 8 int64 (the max of the digest and of its
   negation) per rank set, read on the host;
3. only when the digests differ are the descriptions themselves all-gathered (as objects), and
   every rank derives the same :class:`RankDisagreementError` from the same gathered data,
   naming the first parameter that differs, the ranks and what differs.

The optimizer verifies at every step, before any rank rebuilds its plan: a parameter whose
gradient is None on some ranks only (the rank's list changes while its peers' does not) then
ends, on every rank and within the step, in an error naming it, instead of a timeout.
Both collectives have the same shape on every rank whatever the disagreement. Rank sets are
checked in one global order (sorted ranks), so ranks on several overlapping meshes cannot wait
on each other in a cycle; ranks of different pipeline stages, which own different parameters on
different meshes, never compare. The cost per step is one small all-reduce per rank set and one
host read of its result (``scripts/bench_comm.py`` measures it: its "rank check" column).

One case is beyond the check and ends at the collective timeout instead: a rank that has no
parameter at all on a mesh its peers use (it cannot know the mesh exists). Without
``param_names`` the names are positions, so two same-shape parameters swapped within a group
cannot be told apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_plugin.distributed.groups import Domain, process_group
from muon_plugin.distributed.layout import local

# What an entry describes, after its name (the fields compared once the names agree).
FIELDS = ("global shape", "dtype", "mesh", "placements", "settings")
DIGEST_WORDS = 4  # 32 bytes of SHA-256 as int64

Entry = tuple[str, ...]  # (name, *FIELDS)


class RankDisagreementError(ValueError):
    """The ranks of a mesh passed different Muon parameters (or settings) to the planner."""


def describe(name: str, p: Tensor, domain: Domain, settings: Any) -> Entry:
    """One parameter's entry: what every rank of its domain must give identically."""
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names
        mesh = f"ranks {list(domain.ranks)} of shape {domain.mesh_shape}"
        mesh += f" {tuple(names)}" if names else ""
        placements = repr(tuple(p.placements))
    else:
        mesh = f"replicate group ranks {list(domain.ranks)}"
        placements = "plain tensor, replicated"
    return (name, repr(tuple(p.shape)), str(p.dtype), mesh, placements, repr(settings))


class _RankSet:
    """One domain's rank set: what this rank describes there, and its digest."""

    def __init__(self, ranks: tuple[int, ...], header: str, entries: list[Entry], device) -> None:
        self.ranks, self.device = ranks, device
        self.mine = (header, entries)
        digest = hashlib.sha256(repr(self.mine).encode()).digest()
        words = torch.frombuffer(bytearray(digest), dtype=torch.int64)
        # 63-bit words: a word and its negation are both representable.
        self.words = (words & torch.iinfo(torch.int64).max).to(device)

    def verify(self) -> None:
        me = self.ranks.index(dist.get_rank())
        # A group chosen by the rank set alone, so that every member picks the same one.
        group = process_group(Domain(self.ranks, (len(self.ranks),), me, None))
        both = torch.cat([self.words, -self.words])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if torch.equal(both[:DIGEST_WORDS], -both[DIGEST_WORDS:]):  # max == min: all agree
            return
        described: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(described, self.mine, group=group)
        group_ranks = dist.get_process_group_ranks(group)
        raise RankDisagreementError(disagreement_message(group_ranks, described))


class Agreement:
    """What the ranks of each multi-rank domain must agree on, described by this rank.

    ``settings[i]`` is everything about parameter ``i`` beyond its tensor that shapes the plan
    or the math (its spec and group settings); ``plan_settings`` what shapes the whole plan.
    Compared by ``repr``. Building it is local; :meth:`verify` is the collective.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        domains: Sequence[Domain],
        settings: Sequence[Any],
        plan_settings: Any,
    ) -> None:
        entries: dict[tuple[int, ...], list[Entry]] = {}
        devices: dict[tuple[int, ...], torch.device] = {}
        for p, name, domain, setting in zip(params, names, domains, settings, strict=True):
            if domain.size == 1:
                continue
            key = tuple(sorted(domain.ranks))
            entries.setdefault(key, []).append(describe(name, p, domain, setting))
            devices.setdefault(key, local(p).device)
        header = repr(plan_settings)
        self.rank_sets = [_RankSet(k, header, entries[k], devices[k]) for k in sorted(entries)]

    def verify(self) -> None:
        """Raise :class:`RankDisagreementError` on every rank of a domain whose ranks disagree.
        Must be called by every rank with its own agreement (a collective)."""
        for rank_set in self.rank_sets:
            rank_set.verify()


def check_agreement(
    params: Sequence[Tensor],
    names: Sequence[str],
    domains: Sequence[Domain],
    settings: Sequence[Any],
    plan_settings: Any,
) -> None:
    """:class:`Agreement` of these lists, verified (a collective)."""
    Agreement(params, names, domains, settings, plan_settings).verify()


def disagreement_message(ranks: Sequence[int], described: Sequence[tuple[str, list[Entry]]]) -> str:
    """The error for ranks ``ranks`` that gave ``described`` (header, entries); same everywhere."""
    lead = (
        f"ranks {list(ranks)} disagree on the Muon parameters of their device mesh; every rank "
        "of a mesh must give the optimizer the same parameters with gradients (same names, "
        "shapes, placements, dtypes and settings, in the same order)"
    )
    headers = [h for h, _ in described]
    if len(set(headers)) > 1:
        return f"{lead}: the optimizer settings differ: {_by_value(ranks, headers)}"
    lists = [e for _, e in described]
    name_sets = [{e[0] for e in es} for es in lists]
    counts = ", ".join(f"rank {r}: {len(es)}" for r, es in zip(ranks, lists, strict=True))
    for es in lists:
        for e in es:
            lacking = [r for r, s in zip(ranks, name_sets, strict=True) if e[0] not in s]
            if lacking:
                having = [r for r, s in zip(ranks, name_sets, strict=True) if e[0] in s]
                return (
                    f"{lead}: parameter {e[0]!r} (global shape {e[1]}) is given on "
                    f"{_ranks(having)} but not on {_ranks(lacking)} (a gradient on some ranks "
                    f"only?); parameters given per rank: {counts}"
                )
    if len({len(es) for es in lists}) > 1:
        return f"{lead}: different numbers of parameters ({counts})"
    for pos in range(len(lists[0])):
        column = [es[pos] for es in lists]
        if len(set(column)) == 1:
            continue
        names = [e[0] for e in column]
        if len(set(names)) > 1:
            return (
                f"{lead}: the parameters come in a different order: position {pos} is "
                f"{_by_value(ranks, names, quote=True)} (build param groups in a deterministic "
                "order, e.g. not from a set)"
            )
        diffs = [
            f"{field} {_by_value(ranks, [e[f + 1] for e in column])}"
            for f, field in enumerate(FIELDS)
            if len({e[f + 1] for e in column}) > 1
        ]
        return f"{lead}: parameter {names[0]!r} (position {pos}) differs in " + "; ".join(diffs)
    return f"{lead}: their descriptions differ"  # unreachable: equal lists hash equally


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _by_value(ranks: Sequence[int], values: Sequence[str], quote: bool = False) -> str:
    """``A on ranks [0, 2], B on rank 1``: each distinct value with the ranks that gave it."""
    order: dict[str, list[int]] = {}
    for r, v in zip(ranks, values, strict=True):
        order.setdefault(v, []).append(r)
    return ", ".join(f"{repr(v) if quote else v} on {_ranks(rs)}" for v, rs in order.items())
