"""Text rendering of an orthogonalization plan report (what rank 0 logs at start-up)."""

from __future__ import annotations

from typing import Any


def format_bytes(n: float) -> str:
    """``n`` bytes in a short human unit."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_report(rows: list[dict[str, Any]]) -> str:
    """One line per shape group: layout, matrices, and the busiest rank's load and traffic."""
    if not rows:
        return "Muon orthogonalization plan: empty (no Muon step yet)"
    header = (
        f"{'shape':>20} {'dtype':>9} {'placements':>34} {'matrices':>8} "
        f"{'per rank (min-max)':>18} {'max send':>10} {'max recv':>10} {'max GFLOP':>10}"
    )
    lines = ["Muon orthogonalization plan:", header]
    for row in rows:
        per_rank = row["matrices_per_rank"]
        lines.append(
            f"{str(tuple(row['shape'])):>20} {row['dtype']:>9} {str(row['placements']):>34} "
            f"{row['matrices']:>8} {f'{min(per_rank)}-{max(per_rank)}':>18} "
            f"{format_bytes(max(row['send_bytes_per_rank'])):>10} "
            f"{format_bytes(max(row['recv_bytes_per_rank'])):>10} "
            f"{max(row['flops_per_rank']) / 1e9:>10.2f}"
        )
    return "\n".join(lines)
