"""The param-group table logged when an optimizer is built: per parameter class, its algorithm
(``normuon`` for a Muon group with NorMuon's normalization), parameter count and size, lr, the
lr Muon applies after ``lr_adjust``, and weight decay."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from muon_plugin.defaults import DEFAULTS
from muon_plugin.group_settings import group_spec
from muon_plugin.orthogonalize import lr_shape_factor


def muon_lr_range(group: Mapping[str, Any]) -> tuple[float, float] | None:
    """The smallest and largest learning rate a Muon group applies after ``lr_adjust`` (its
    ``lr`` times each matrix's shape factor); ``None`` for Adam(W) groups. Settings the group
    leaves out take the optimizer's defaults."""
    group = {**DEFAULTS, **group}
    if group["algorithm"] != "muon" or not group["params"]:
        return None
    spec = group_spec(group)
    factors = [
        lr_shape_factor(*spec.matrix_view(tuple(p.shape))[1:], spec.lr_adjust)
        for p in group["params"]
    ]
    return group["lr"] * min(factors), group["lr"] * max(factors)


def algorithm_label(group: Mapping[str, Any]) -> str:
    """The algorithm column: the group's algorithm, ``"normuon"`` for a Muon group that
    normalizes rows (settings the group leaves out take the optimizer's defaults)."""
    group = {**DEFAULTS, **group}
    if group["algorithm"] == "muon" and group["normalization"] != "none":
        return group["normalization"]
    return group["algorithm"]


def format_rules_table(groups: Sequence[Mapping[str, Any]], classes: Sequence[str]) -> str:
    """A plain-text table: class, algorithm, count, #parameters, lr, the lr Muon applies
    after ``lr_adjust`` (a range over the group's matrix shapes), weight decay."""
    header = ("class", "algorithm", "count", "#params", "lr", "muon lr", "weight decay")
    rows = [header]
    total_n, total_p = 0, 0
    for g, c in zip(groups, classes, strict=True):
        n = len(g["params"])
        p = sum(int(t.numel()) for t in g["params"])  # a DTensor's numel() is global
        total_n += n
        total_p += p
        span = muon_lr_range(g)
        if span is None:
            effective = "-"
        elif f"{span[0]:.3g}" == f"{span[1]:.3g}":
            effective = f"{span[0]:.3g}"
        else:
            effective = f"{span[0]:.3g}-{span[1]:.3g}"
        rows.append(
            (c, algorithm_label(g), str(n), f"{p:,}", f"{g['lr']:.3g}", effective, f"{g['wd']:.3g}")
        )
    rows.append(("total", "", str(total_n), f"{total_p:,}", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[j].ljust(widths[j]) if j < 2 else r[j].rjust(widths[j]) for j in range(len(r))]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
