"""What one step row is: a named optimizer factory, the context it runs in, why it is skipped;
and the check that a row's patch of the code it times really ran."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch


class Patched:
    """What a row's patch replaced, and how often the replacement was called: a row whose
    patch is never called would time the unpatched code under the ablation's name.

    A row's ``context`` yields one (checked after the row's steps) or None (nothing to check,
    e.g. an environment switch). ``on_cpu=False``: the patched code runs only on a GPU (the
    CPU takes the torch paths without asking it), so a CPU run does not check it.
    """

    def __init__(self, what: str, on_cpu: bool = True):
        self.what = what
        self.on_cpu = on_cpu
        self.calls = 0

    def counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, counting its calls."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return fn(*args, **kwargs)

        return counted

    def verify(self, cuda: bool) -> None:
        """Raise when the replacement was never called where it should have been."""
        if self.calls == 0 and (cuda or self.on_cpu):
            raise RuntimeError(f"the row's patch of {self.what} was never called")


@contextlib.contextmanager
def row_patch(
    target: Any, attribute: str, replacement: Callable[..., Any], on_cpu: bool = True
) -> Iterator[Patched]:
    """``target.attribute`` replaced by ``replacement`` (its calls counted) while the context
    is active; yields the :class:`Patched`."""
    patched = Patched(f"{getattr(target, '__name__', target)}.{attribute}", on_cpu)
    with mock.patch.object(target, attribute, patched.counting(replacement)):
        yield patched


@dataclass
class Row:
    name: str
    group: str  # "ours", "torch", "reference", "peer", "elementwise"
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None
    context: Callable[[], contextlib.AbstractContextManager[Patched | None]] | None = None
    """Entered around the row (building the optimizer and every step); the :class:`Patched`
    it yields, if any, is verified after the steps."""
    skip: str | None = None
    required: bool = False  # an error here makes the script exit non-zero
