"""The end-of-run summary every framework's layer logs on rank 0::

    Run summary: 30 logged steps (1-30) in 41.2 s
      loss: final 5.1234, mean of the last 10 logged steps 5.2345
      throughput: 12,345 tokens/s over all ranks (after step 1 to step 30)
      peak memory (rank 0): 1.23 GiB
      checkpoints: outputs/x/checkpoint (step-10, step-20, step-30)

:class:`RunSummary` records what the framework logs at each log step (loss, global token count,
peak device memory, Muon's skipped updates) and formats it; the framework layer feeds it from
its own metrics logger and logs :meth:`RunSummary.format` when the run ends.
"""

from __future__ import annotations

import os
import time

__all__ = ["LAST_STEPS", "RunSummary"]

LAST_STEPS = 10
"""The summary's mean loss is over this many last logged steps."""


def _number(text: str) -> int:
    return int(text) if text.isdigit() else -1


class RunSummary:
    """What one run logged: loss per step, global tokens, peak memory; formats the summary."""

    def __init__(
        self,
        checkpoint_folder: str | None = None,
        checkpoint_prefixes: tuple[str, ...] = ("step-",),
    ) -> None:
        """``checkpoint_folder``: where the run saves checkpoints, None when it does not;
        ``checkpoint_prefixes``: how the names of its checkpoints start (a number follows)."""
        self.checkpoint_folder = checkpoint_folder
        self.checkpoint_prefixes = checkpoint_prefixes
        self.rates: list[float] = []
        self.start = time.perf_counter()
        self.losses: list[tuple[int, float]] = []
        self.first_log: tuple[float, int] | None = None  # (time, global tokens) at the first log
        self.last_log: tuple[float, int] | None = None
        self.peak_memory_gib = 0.0
        self.skipped = 0

    def record(
        self,
        step: int,
        loss: float,
        tokens: int | None,
        memory_gib: float,
        now: float,
        tokens_per_s: float | None = None,
    ) -> None:
        """One log step: ``tokens`` is the global token count so far (None if the framework
        does not log it), ``tokens_per_s`` the step's own rate over all ranks (if it logs
        that instead)."""
        self.losses.append((step, float(loss)))
        if tokens_per_s is not None:
            self.rates.append(float(tokens_per_s))
        self.peak_memory_gib = max(self.peak_memory_gib, float(memory_gib))
        if tokens is not None:
            if self.first_log is None:
                self.first_log = (now, int(tokens))
            self.last_log = (now, int(tokens))

    def checkpoints(self) -> str:
        """The checkpoint folder and the checkpoints in it, as the summary shows them."""
        folder = self.checkpoint_folder
        if folder is None:
            return "none (checkpointing off)"
        names = os.listdir(folder) if os.path.isdir(folder) else []
        steps = [
            name
            for prefix in self.checkpoint_prefixes
            for name in sorted(
                (n for n in names if n.startswith(prefix)), key=lambda n: _number(n[len(prefix) :])
            )
        ]
        return f"{folder} ({', '.join(steps) if steps else 'none saved'})"

    def format(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        if not self.losses:
            return f"Run summary: no step logged, {now - self.start:.1f} s"
        first, last = self.losses[0][0], self.losses[-1][0]
        tail = self.losses[-LAST_STEPS:]
        mean = sum(v for _, v in tail) / len(tail)
        lines = [
            f"Run summary: {len(self.losses)} logged steps ({first}-{last}) in "
            f"{now - self.start:.1f} s",
            f"  loss: final {self.losses[-1][1]:.4f}, mean of the last {len(tail)} logged "
            f"steps {mean:.4f}",
        ]
        if self.first_log and self.last_log and self.last_log[0] > self.first_log[0]:
            rate = (self.last_log[1] - self.first_log[1]) / (self.last_log[0] - self.first_log[0])
            lines.append(
                f"  throughput: {rate:,.0f} tokens/s over all ranks (after step {first} to "
                f"step {last})"
            )
        elif self.rates:
            rates = sorted(self.rates)
            lines.append(
                f"  throughput: {rates[len(rates) // 2]:,.0f} tokens/s over all ranks (median of "
                f"{len(rates)} logged steps)"
            )
        lines.append(f"  peak memory (rank 0): {self.peak_memory_gib:.2f} GiB")
        if self.skipped:
            lines.append(f"  Muon updates skipped (non-finite, rank 0): {self.skipped}")
        lines.append(f"  checkpoints: {self.checkpoints()}")
        log_file = os.environ.get("MUON_RUN_LOG")
        if log_file:
            lines.append(f"  log: {log_file}")
        return "\n".join(lines)
