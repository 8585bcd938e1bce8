"""An orthogonalization plan's report: its shape groups as data, and as the text rank 0 logs."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from muon_plugin.distributed.layout import describe_placements
from muon_plugin.distributed.planner import ShapeGroup
from muon_plugin.distributed.schedule import WIRE_BYTES


def report_rows(groups: Sequence[ShapeGroup]) -> list[dict[str, Any]]:
    """Per shape group: layout, matrices, and matrices/bytes/FLOPs per rank of its mesh.

    Lists are indexed by linear mesh index; ``ranks`` gives the global rank of each entry.
    Bytes count both directions of a step (shards to their owners, results back).
    ``backend`` and ``path`` say how this rank orthogonalizes its stack of the group (the
    backend's name and its resolved path, e.g. ``"gram, triton(tma), graph"``).
    ``normalization`` is ``"normuon"`` for a group whose rows are normalized (else ``"none"``);
    then ``row_state_bytes_per_rank`` counts the fp32 per-row second moments each rank holds
    for the group's parameters and ``row_send_bytes_per_rank`` the part of the sent bytes that
    carries them (both 0 without normalization).
    """
    rows = []
    for g in groups:
        send = [a + b for a, b in zip(g.gather_send_bytes, g.back_send_bytes, strict=True)]
        recv = [a + b for a, b in zip(g.gather_recv_bytes, g.back_recv_bytes, strict=True)]
        local = g.domain.size == 1 and g.domain.source is None
        rows.append(
            {
                "shape": g.shape,
                "dtype": str(g.dtype).removeprefix("torch."),
                "placements": "local" if local else describe_placements(g.layout.placements),
                "mesh": "x".join(map(str, g.domain.mesh_shape)),
                "ranks": list(g.domain.ranks),
                "params": len(g.indices),
                "names": list(g.names),
                "matrices": len(g.units),
                "matrix_shape": g.unit_shape,
                "matrices_per_rank": list(g.matrices_per_rank),
                "send_bytes_per_rank": send,
                "recv_bytes_per_rank": recv,
                "gather_send_bytes_per_rank": list(g.gather_send_bytes),
                "return_send_bytes_per_rank": list(g.back_send_bytes),
                "flops_per_rank": list(g.flops_per_rank),
                "collectives": int(g.gather_comm) + int(g.back_comm),
                "backend": g.path.backend if g.path else g.spec.backend,
                "path": g.path.describe() if g.path else "",
                "normalization": "none" if g.rows is None else "normuon",
                "row_state_bytes_per_rank": _row_state_bytes(g),
                "row_send_bytes_per_rank": _row_send_bytes(g),
            }
        )
    return rows


def _row_state_bytes(g: ShapeGroup) -> list[int]:
    """Bytes of the per-row states each rank holds for ``g``'s parameters (its rows companion's
    local pieces, replicas included)."""
    if g.rows is None:
        return [0] * g.domain.size
    layout = g.rows.layout
    per_param = [math.prod(layout.local_shape(j)) * WIRE_BYTES for j in range(g.domain.size)]
    return [n * len(g.indices) for n in per_param]


def _row_send_bytes(g: ShapeGroup) -> list[int]:
    if g.rows is None:
        return [0] * g.domain.size
    r = g.rows
    return [a + b for a, b in zip(r.gather_send_bytes, r.back_send_bytes, strict=True)]


def format_bytes(n: float) -> str:
    """``n`` bytes in a short human unit."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def totals_per_rank(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Matrices, FLOPs and bytes per global rank, summed over the shape groups of ``rows``.

    Rows without ``ranks`` (a purely local plan) count as rank 0.
    """
    out: dict[int, dict[str, float]] = defaultdict(
        lambda: {"matrices": 0, "flops": 0.0, "send_bytes": 0, "recv_bytes": 0}
    )
    for row in rows:
        ranks = row.get("ranks") or list(range(len(row["matrices_per_rank"])))
        for j, rank in enumerate(ranks):
            t = out[rank]
            t["matrices"] += row["matrices_per_rank"][j]
            t["flops"] += row["flops_per_rank"][j]
            t["send_bytes"] += row["send_bytes_per_rank"][j]
            t["recv_bytes"] += row["recv_bytes_per_rank"][j]
    return dict(out)


def format_report(rows: list[dict[str, Any]]) -> str:
    """One line per shape group (layout, matrices, the busiest rank's load and traffic, the
    backend and its path on this rank), then the totals over all groups per rank (min-max),
    which is what load balancing evens out."""
    if not rows:
        return "Muon orthogonalization plan: empty (no Muon step yet)"
    header = (
        f"{'shape':>20} {'dtype':>9} {'mesh':>7} {'placements':>22} {'matrices':>8} "
        f"{'per rank (min-max)':>18} {'max send':>10} {'max recv':>10} {'max GFLOP':>10}  "
        "backend: path"
    )
    lines = ["Muon orthogonalization plan (per step):", header]
    for row in rows:
        per_rank = row["matrices_per_rank"]
        lines.append(
            f"{str(tuple(row['shape'])):>20} {row['dtype']:>9} {row.get('mesh', '-'):>7} "
            f"{str(row['placements']):>22} {row['matrices']:>8} "
            f"{f'{min(per_rank)}-{max(per_rank)}':>18} "
            f"{format_bytes(max(row['send_bytes_per_rank'])):>10} "
            f"{format_bytes(max(row['recv_bytes_per_rank'])):>10} "
            f"{max(row['flops_per_rank']) / 1e9:>10.2f}  {_backend(row)}"
        )
    totals = totals_per_rank(rows)
    matrices = [t["matrices"] for t in totals.values()]
    flops = [t["flops"] for t in totals.values()]
    sends = [t["send_bytes"] for t in totals.values()]
    mean = sum(flops) / len(flops)
    lines.append(
        f"all groups, {len(totals)} rank(s): matrices {min(matrices)}-{max(matrices)}, "
        f"GFLOP {min(flops) / 1e9:.2f}-{max(flops) / 1e9:.2f} "
        f"(max/mean {max(flops) / mean if mean else 1.0:.2f}), "
        f"sent {format_bytes(min(sends))}-{format_bytes(max(sends))}, "
        f"collectives {sum(row.get('collectives', 0) for row in rows)}"
    )
    normalized = [row for row in rows if row.get("normalization", "none") != "none"]
    if normalized:
        state = _per_rank_sum(normalized, "row_state_bytes_per_rank")
        sent = _per_rank_sum(normalized, "row_send_bytes_per_rank")
        lines.append(
            f"normuon second moments: {len(normalized)} group(s), "
            f"{format_bytes(min(state))}-{format_bytes(max(state))} held per rank, "
            f"{format_bytes(max(sent))} of the max sent"
        )
    return "\n".join(lines)


def _per_rank_sum(rows: list[dict[str, Any]], key: str) -> list[float]:
    """``key``'s per-rank lists summed per global rank over ``rows``."""
    out: dict[int, float] = defaultdict(float)
    for row in rows:
        ranks = row.get("ranks") or list(range(len(row[key])))
        for j, rank in enumerate(ranks):
            out[rank] += row[key][j]
    return list(out.values())


def _backend(row: dict[str, Any]) -> str:
    backend, path = row.get("backend", "-"), row.get("path", "")
    text = f"{backend}: {path}" if path and path != backend else backend
    normalization = row.get("normalization", "none")
    return text if normalization == "none" else f"{text} + {normalization}"
