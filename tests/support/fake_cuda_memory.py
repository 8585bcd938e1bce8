"""Peak memory of code run on fake CUDA tensors, on a machine without a GPU.

``FakeTensorMode`` gives tensors a device, shape and dtype but no data, so an optimizer step
at full size runs here in seconds and without memory; :class:`LiveBytes` adds up the bytes of
every storage alive while it runs, which is what the CUDA caching allocator must hold at
least. Two things a CPU-only torch cannot do on fake CUDA tensors are worked around while
:func:`fake_cuda` is active: Python indexing (it asks for a CUDA device guard; slices and
integers become ``narrow`` and ``select``) and the plan's layout arithmetic (index tensors whose
values it reads; computed on real CPU tensors).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages created under this mode and still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += self.live[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _getitem_by_narrow(original):
    def getitem(self: torch.Tensor, index):
        items = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(i, int | slice) for i in items):
            return original(self, index)
        out, dim = self, 0
        for item in items:
            if isinstance(item, int):
                out = out.select(dim, item)
                continue
            start, stop, step = item.indices(out.shape[dim])
            assert step == 1, "only unit-step slices"
            out = out.narrow(dim, start, max(0, stop - start))
            dim += 1
        return out

    return getitem


@contextlib.contextmanager
def fake_cuda(monkeypatch) -> Iterator[FakeTensorMode]:
    """A ``FakeTensorMode`` in which muon_plugin's plan can be built and run on CUDA tensors."""
    import muon_plugin.distributed.validation as validation

    layout_of = validation.layout_of

    def real_layout_of(*args, **kwargs):
        with unset_fake_temporarily():
            return layout_of(*args, **kwargs)

    monkeypatch.setattr(validation, "layout_of", real_layout_of)
    monkeypatch.setattr(torch.Tensor, "__getitem__", _getitem_by_narrow(torch.Tensor.__getitem__))
    with FakeTensorMode() as mode:
        yield mode
