"""The QK-Clip lines a training run logs, read back, and the check every framework's run makes.

A line (rank 0, at each logged step)::

    QK-Clip: max logit 0.8099 (layers.4.attention), 16 heads clipped at tau 0.7: layers.4.
    attention h5 0.8099, ..., +8 more; heads clipped at the previous step now: layers.1.
    attention h10 0.68, ...

(one line in the log)

lists the heads the step clipped (largest first, at most 8 named) with their max logit, and the
max logit this step of each head the previous step clipped.

Why the next step's logit of a clipped head is at most ``tau`` times a small factor, not
``tau``: the clip at step t uses the maxima measured in step t's forward, on the weights before
step t's update, and multiplies the weights after that update. Step t + 1 then sees
``gamma * S(updated weights, next batch)`` = ``tau * S(W_t, b_{t+1}) / S(W_{t-1}, b_t)``: tau
times the one-step change of that head's max logit (one Muon update and another batch), which
is exactly what any unclipped head's max logit does from one step to the next. Those runs train
their debug models at an lr of 3e-3 to 1e-2 through the warm-up, where a head's max logit rises
by up to about a third in one step (measured: at most x1.36 over every clipped head of the
0.2.2 llama3 run, x0.98 on TorchTune's), so :data:`NEXT_STEP_FACTOR` is 1.5: a clip that did
nothing would leave the head at its (already > tau) value times that same change, and one that
was applied twice, or to the wrong head, shows at once in ``tests/test_qk_clip*.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

NEXT_STEP_FACTOR = 1.5

LINE_RE = re.compile(
    r"QK-Clip: max logit (?P<max>\S+?)(?: \((?P<where>[^)]*)\))?, (?P<n>\d+) heads clipped at "
    r"tau (?P<tau>[0-9.e+-]+)(?P<rest>.*)$",
    re.M,
)
HEAD_RE = re.compile(r"(\S+) h(\d+) (-?[0-9.]+(?:e[+-]?\d+)?|-?inf|nan)")


@dataclass
class ClipLine:
    max_logit: float
    n_clipped: int
    tau: float
    clipped: list[tuple[str, int, float]] = field(default_factory=list)
    after: list[tuple[str, int, float]] = field(default_factory=list)


def clip_lines(log: str) -> list[ClipLine]:
    """Every QK-Clip report line of ``log``, in order."""
    out = []
    for m in LINE_RE.finditer(log):
        rest = m.group("rest")
        clipped_text, _, after_text = rest.partition("; heads clipped at the previous step now:")

        def heads(text: str) -> list[tuple[str, int, float]]:
            return [(n, int(h), float(v)) for n, h, v in HEAD_RE.findall(text)]

        out.append(
            ClipLine(
                float(m.group("max")),
                int(m.group("n")),
                float(m.group("tau")),
                heads(clipped_text),
                heads(after_text),
            )
        )
    return out


def check_clipping(log: str, tau: float, factor: float = NEXT_STEP_FACTOR) -> list[ClipLine]:
    """The run clipped, named the heads it clipped (each above tau), and every head it clipped
    was at most ``tau * factor`` at the next step."""
    lines = clip_lines(log)
    assert lines, "no QK-Clip line in the log:\n" + log[-3000:]
    assert all(line.tau == tau for line in lines)
    assert any(line.n_clipped for line in lines), [line.max_logit for line in lines]
    for line in lines:
        assert all(s > tau for _, _, s in line.clipped), line
        assert len(line.clipped) == min(line.n_clipped, 8), line
    after = [s for line in lines for _, _, s in line.after]
    assert after, "no step followed a clip"
    assert max(after) <= tau * factor, (max(after), tau, [line.after for line in lines])
    return lines
