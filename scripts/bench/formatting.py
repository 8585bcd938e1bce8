"""Numbers and tables as text: the printed lines, the text tables, the markdown tables."""

from __future__ import annotations

import math
from typing import Any


def tf(x: float) -> str:
    """TFLOP/s with sensible digits (a CPU reaches well under 1)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def fmt(v: Any, spec: str = ".3f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if math.isnan(v):
            return none
        return format(v, spec)
    return str(v)


def spread(r: dict, key: str, spec: str = ".3f") -> str:
    """``r[key]``, with the range over repeated runs where there is one: ``median (min-max)``."""
    value = fmt(r.get(key), spec)
    rng = r.get(f"{key}_range")
    if value == "-" or not rng or rng[0] == rng[1]:
        return value
    return f"{value} ({rng[0]:{spec}}-{rng[1]:{spec}})"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: list[str], body: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)
