"""Copies of an optimizer (``copy.deepcopy``, pickling, ``torch.save``) that keep its
configuration, not only ``torch.optim``'s defaults, state and param groups.
"""

from __future__ import annotations

import copy
from typing import Any

from torch.optim import Optimizer


class CopyableOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` whose configuration attributes survive copies.

    ``config_attributes`` are kept by pickling and ``deepcopy``; of them, the
    ``shared_attributes`` (process groups: not picklable, not copyable) are shared by a deep
    copy and set to None by pickling. Caches derived from the configuration are rebuilt by
    :meth:`_rebuild_caches` after unpickling.
    """

    config_attributes: tuple[str, ...] = ()
    shared_attributes: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self.config_attributes:
            state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._rebuild_caches()

    def __reduce_ex__(self, protocol: Any) -> Any:
        reduced = super().__reduce_ex__(protocol)
        dropped = [n for n in self.shared_attributes if getattr(self, n) is not None]
        if not dropped or not isinstance(reduced, tuple) or len(reduced) < 3:
            return reduced
        state = dict(reduced[2])
        for name in dropped:
            state[name] = None
        return (*reduced[:2], state, *reduced[3:])

    def __deepcopy__(self, memo: dict[int, Any]) -> CopyableOptimizer:
        for name in self.shared_attributes:
            value = getattr(self, name)
            if value is not None:
                memo[id(value)] = value
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def _rebuild_caches(self) -> None:
        """Rebuild what derives from the configuration and the param groups (after a copy)."""
