"""The QK-Clip part of the convergence benchmark (``scripts/bench_convergence.py --qk-clip``).

Two runs at Muon's best lr and seed 0, both logging the largest attention logit of every
logged step (QK-Clip's report line, ``QK-Clip: max logit X ...``):

- ``muon-maxlogit``: QK-Clip's statistic only (``qk_clip_tau`` 1e30: nothing is ever clipped),
  the max-logit curve of plain Muon;
- ``muon-qkclip<tau>``: QK-Clip at ``tau``; ``--qk-clip auto`` takes half the largest logit the
  ``muon-maxlogit`` run reached, so that the clip acts for most of the run.

The summary compares the two: the max-logit curves (the largest logit and the last one), the
heads clipped and the final validation loss of both; :func:`plot` draws the curves.
"""

from __future__ import annotations

import re
from pathlib import Path

MAXLOGIT = "muon-maxlogit"
QKCLIP = "muon-qkclip"
NEVER = 1e30  # a tau no logit reaches: the statistic is recorded and logged, nothing clipped

LINE_RE = re.compile(r"QK-Clip: max logit (\S+?)(?: \([^)]*\))?, (\d+) heads clipped")
STEP_RE = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:")


def is_variant(optimizer: str) -> bool:
    """Whether ``optimizer`` (a run's name part) is one of the QK-Clip runs."""
    return optimizer == MAXLOGIT or optimizer.startswith(QKCLIP)


def job_args(optimizer: str) -> list[str]:
    """The job overrides of a QK-Clip run: Muon with ``qk_clip_tau``."""
    tau = NEVER if optimizer == MAXLOGIT else float(optimizer.removeprefix(QKCLIP))
    return ["--optimizer.name", "muon", "--optimizer.muon.qk_clip_tau", f"{tau:g}"]


def parse(text: str) -> list[list[float]]:
    """``[[step, max logit, heads clipped]]`` of a run's log: each QK-Clip line belongs to the
    training step line that follows it."""
    out, pending = [], None
    for line in text.splitlines():
        m = LINE_RE.search(line)
        if m:
            pending = (float(m.group(1)), int(m.group(2)))
            continue
        s = STEP_RE.search(line)
        if s and pending is not None:
            out.append([int(s.group(1)), *pending])
            pending = None
    return out


def clip_tau(setting: str, records: list[dict]) -> float | None:
    """The tau of the clipping run: ``setting`` as a number, or (``"auto"``) half the largest
    logit of the finished ``muon-maxlogit`` run (None until it has finished)."""
    if setting != "auto":
        return float(setting)
    runs = [r for r in records if r["optimizer"] == MAXLOGIT and r.get("max_logit")]
    if not runs:
        return None
    peak = max(v for r in runs for _, v, _ in r["max_logit"])
    return float(f"{peak / 2:.3g}")


def table(records: list[dict]) -> tuple[list[str], dict]:
    """The comparison table (markdown lines) and its numbers."""
    runs = [r for r in records if r["status"] == "ok" and is_variant(r["optimizer"])]
    if not runs:
        return [], {}
    lines = [
        "",
        "| QK-Clip run | tau | largest max logit | last max logit | heads clipped (logged "
        "steps) | final val loss |",
        "|" + " --- |" * 6,
    ]
    head = {}
    for r in sorted(runs, key=lambda r: r["optimizer"]):
        curve = r.get("max_logit") or [[0, float("nan"), 0]]
        name = r["optimizer"]
        tau = "none (statistic only)" if name == MAXLOGIT else name[len(QKCLIP) :]
        row = {
            "largest": max(v for _, v, _ in curve),
            "last": curve[-1][1],
            "clipped": sum(n for _, _, n in curve),
            "final_val": r["val"][-1][1] if r["val"] else float("nan"),
        }
        head[r["optimizer"]] = row
        lines.append(
            f"| {r['name']} | {tau} | {row['largest']:.4g} | {row['last']:.4g} | "
            f"{row['clipped']} | {row['final_val']:.4f} |"
        )
    return lines, head


def plot(records: list[dict], path: Path) -> bool:
    """The max-logit curves of the QK-Clip runs (PNG); False without matplotlib or runs."""
    runs = [r for r in records if r["status"] == "ok" and is_variant(r["optimizer"])]
    if not runs:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        curve = r.get("max_logit") or []
        ax.plot([s for s, _, _ in curve], [v for _, v, _ in curve], label=r["name"])
        if r["optimizer"] != MAXLOGIT:
            ax.axhline(float(r["optimizer"][len(QKCLIP) :]), ls=":", color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("largest attention logit")
    ax.set_title("QK-Clip: largest pre-softmax logit per logged step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
