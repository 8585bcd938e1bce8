"""What one run measures and at which sizes: the sections, the workloads, the selection of rows
(``--rows``, ``--workloads``, ``--budget``), and the sizes and repetition counts per device."""

from __future__ import annotations

import time
from dataclasses import dataclass

SECTIONS = ("kernels", "ortho", "step", "memory")
"""The sections, as ``--sections`` names them, in the order they run."""

WORKLOADS = ("llama", "gpt", "llama-bf16")
"""The step section's workloads, as ``--workloads`` names them."""

LR, WD = 1e-3, 0.1
"""Learning rate and weight decay of every optimizer row."""


@dataclass(frozen=True)
class Selection:
    """Which step rows and workloads run, and until when (``--rows``, ``--workloads``,
    ``--budget``): a run cut short by a time limit should still leave its rows."""

    rows: tuple[str, ...] = ()
    """Lower-case substrings of row names; a row runs if its name contains one (empty: all)."""
    workloads: tuple[str, ...] = WORKLOADS
    deadline: float | None = None
    """``time.perf_counter()`` after which no new row starts (its row is marked skipped)."""

    def takes(self, row_name: str) -> bool:
        return not self.rows or any(p in row_name.lower() for p in self.rows)

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


@dataclass(frozen=True)
class Config:
    """Sizes and repetition counts of one run."""

    full: bool  # the real sizes (GPU, not --quick)
    div: int  # matrix dims are divided by this
    llama_layers: int
    gpt_layers: int
    peak_n: int  # n of the n^3 bf16 matmul that measures the peak
    step_warmup: int
    step_iters_large: int  # timed steps, Llama workload
    step_iters_small: int  # timed steps, GPT workload
    compile_row: bool
    select: Selection = Selection()


def make_config(cuda: bool, quick: bool, compile_flag: bool | None) -> Config:
    """The sizes of a run: full on a GPU, small otherwise (``--quick``: smallest)."""
    if cuda and not quick:
        return Config(True, 1, 4, 12, 8192, 3, 8, 20, compile_flag is not False)
    if quick:  # the CI smoke test: every row, as little work as possible
        return Config(False, 16, 1, 3, 512, 1, 3, 3, bool(compile_flag))
    return Config(False, 16, 2, 6, 512, 1, 5, 5, bool(compile_flag))


def scale_shape(shape: tuple[int, ...], div: int) -> tuple[int, ...]:
    """Divide the two matrix dims by ``div`` (batch dims are kept)."""
    return (*shape[:-2], max(1, shape[-2] // div), max(1, shape[-1] // div))


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)
