"""What two other distributed Muons do per step for the same models, as their code reads.

**microsoft/dion** ``Muon`` (commit 0a059a4; ``dion/muon.py``, ``dion/megabatch_base.py``):

- one optimizer over a 1-D mesh (``DistributedOrthoBase`` refuses a 2-D ``DeviceMesh``); a
  parameter sharded on two matrix dims raises ``NotImplementedError`` ("multiple sharded
  dimensions"), so FSDP x TP is not supported; under HSDP it runs over the shard mesh and
  every replica repeats the work;
- parameters are grouped by (global shape, placements, dtype); a group of ``n`` matrices
  sharded on a matrix dim over ``W`` ranks is padded with zero matrices to a multiple of ``W``
  and each local shard with zero rows to ``ceil(rows / W)``; one ``dist.all_to_all`` gives each
  rank ``ceil(n / W)`` whole padded matrices, Newton-Schulz runs on them, a second
  ``all_to_all`` sends the pieces back; the momentum is cast to bf16 before communication;
- expert stacks sharded on the expert dim only need no communication; experts sharded inside
  the matrix (``Shard(1)`` on the ``efsdp`` mesh) need an optimizer over that mesh.

**torchtitan 0.3.0** ``DistMuon`` (``torchtitan/distributed/flex_shard/dist_muon.py``,
``_optimizer_reshard_schedule.py``, ``_optimizer_reshard_runtime.py``; the configuration in
``models/kimi_k2_7/config_registry.py``):

- 2-D matrices are ``Owned`` over the ``dp_shard`` axis (every other storage axis must be
  replicated: under HSDP each replica repeats the work; TP and PP are refused by its configs);
  owners by a largest-first heuristic inside each *bucket* (ties to the least cumulative load),
  cost ``ns_steps * s^2 * (2 l + s)`` (proportional to ours);
- per bucket one packed ``all_to_all_single`` to the owners and one back, in the parameters'
  storage dtype (fp32 master weights: 4 bytes per element); buckets are lists of layers (the
  Kimi config: the first layer, then pairs of layers); here one bucket per layer;
- expert stacks are computed ``Shard(0)`` (whole experts): no traffic where FSDP also shards
  the expert dim, a redistribution over ``efsdp`` where it shards dim 1.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from scale_shapes import HSDP_SHARD, Model

DION_WIRE = 2  # bf16
DISTMUON_WIRE = 4  # fp32 storage


@dataclass(frozen=True)
class PeerStep:
    """One optimizer's step on the busiest rank: FLOPs, bytes sent, collectives; or refused."""

    flops: float = 0.0
    sent: int = 0
    collectives: int = 0
    refused: str = ""


def chunk_rows(rows: int, w: int) -> list[int]:
    """Rows of each of ``w`` ranks under ``Shard(0)`` (``torch.chunk`` sizes)."""
    size = -(-rows // w)
    return [max(0, min(size, rows - j * size)) for j in range(w)]


def dion(model: Model, layout: str, n: int, ep: int, flops) -> PeerStep:
    """dion's Muon on ``model`` laid out as ``layout`` (see the module doc)."""
    if layout == "fsdp_tp":
        return PeerStep(refused="refused: two sharded matrix dims")
    width = HSDP_SHARD if layout == "hsdp" else n
    groups: dict[tuple, int] = defaultdict(int)
    local_flops = 0.0
    for m in model.matrices:
        if not m.expert:
            groups[m.shape, width] += 1
        elif layout != "ep" or n <= model.experts:  # sharded on the expert dim only: local
            local_flops += -(-m.shape[0] // n) * flops(m.shape[1:])
        else:  # experts sharded inside the matrix over efsdp: a megabatch over that mesh
            groups[m.shape, n // ep] += 1
    total_flops, sent, collectives = local_flops, 0, 0
    for (shape, w), count in groups.items():
        per_rank = -(-count // w)
        batch, rows, cols = (shape[0] // ep, *shape[1:]) if len(shape) == 3 else (1, *shape)
        padded_rows = -(-rows // w)
        total_flops += per_rank * batch * flops((padded_rows * w, cols))
        sent += 2 * (w - 1) * per_rank * batch * padded_rows * cols * DION_WIRE
        collectives += 2
    return PeerStep(total_flops, sent, collectives)


def distmuon(model: Model, layout: str, n: int, ep: int, flops) -> PeerStep:
    """torchtitan 0.3's DistMuon on ``model`` laid out as ``layout`` (see the module doc)."""
    if layout == "fsdp_tp":
        return PeerStep(refused="refused: TP")
    w = HSDP_SHARD if layout == "hsdp" else n
    load = [0.0] * w
    sent = [0] * w  # both directions: pieces to the owners, results to the holders
    buckets: dict[str, list] = defaultdict(list)
    expert_flops, expert_sent = 0.0, 0
    for m in model.matrices:
        bucket = buckets[m.name.split(".")[1]]  # a bucket per layer
        if not m.expert:
            bucket.append(m)
            continue
        if layout != "ep":  # FSDP alone shards the expert dim: whole experts, computed there
            expert_flops += -(-m.shape[0] // n) * flops(m.shape[1:])
            continue
        we, local = n // ep, m.shape[0] // ep  # the efsdp group; experts of this ep slice
        mine = -(-local // we)  # whole experts the busiest rank computes (Shard(0) on efsdp)
        expert_flops += mine * flops(m.shape[1:])
        if n > model.experts:  # storage Shard(1): the other rows of its experts come in
            piece = (m.shape[1] // we) * m.shape[2] * DISTMUON_WIRE
            expert_sent += (local - mine) * piece + mine * (we - 1) * piece
    for bucket in buckets.values():
        heap = [(0.0, 0, load[j], j) for j in range(w)]
        heapq.heapify(heap)
        for m in sorted(bucket, key=lambda m: (-flops(m.shape), -m.numel, m.name)):
            primary, secondary, cumulative, j = heapq.heappop(heap)
            cost = flops(m.shape)
            load[j] += cost
            heapq.heappush(heap, (primary + cost, secondary + m.numel, cumulative + cost, j))
            cols = m.numel // m.shape[0]
            for r, rows in enumerate(chunk_rows(m.shape[0], w)):
                own = rows * cols
                sent[r] += (m.numel - own if r == j else own) * DISTMUON_WIRE
    return PeerStep(max(load) + expert_flops, max(sent) + expert_sent, 2 * len(buckets))
