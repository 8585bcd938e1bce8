"""The memory columns: the bytes of an optimizer's state, and CUDA memory above a base (window
peaks, the peak over a row's life, what CUDA-graph pools keep between steps)."""

from __future__ import annotations

import torch

from bench import measure


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state``; views of one storage count that storage once."""
    storages: dict[int, int] = {}

    def walk(v):
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            storages[st.data_ptr() or id(v)] = st.nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for st in opt.state.values():
        walk(st)
    return sum(storages.values())


def pool_bytes(snapshot: list[dict]) -> dict[str, int]:
    """Bytes reserved in a ``torch.cuda.memory_snapshot()``: by the default pool, and by the
    private pools of CUDA graphs."""
    out = {"default": 0, "graphs": 0}
    for segment in snapshot:
        private = tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        out["graphs" if private else "default"] += segment["total_size"]
    return out


class MemoryProbe:
    """CUDA memory above a base: per-window peaks and the peak over a row's whole life.

    The lifetime figure is what a training job must budget beside its params and grads: the
    highest allocation while the optimizer is built and stepped, or, when larger, the memory
    still reserved once the cache is emptied (CUDA-graph pools hold their memory between
    replays without counting it as allocated).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.high = 0
        if cuda:
            measure.free_memory()
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            self.base_reserved = torch.cuda.memory_reserved()
            self.base_pools = pool_bytes(torch.cuda.memory_snapshot())
            self.window_base = self.base
            torch.cuda.reset_peak_memory_stats()

    def kept_mib(self, state: int) -> tuple[float, float]:
        """Where the memory kept between steps goes, in MiB above the base: (allocated beyond
        the optimizer state ``state`` bytes: static graph inputs, library workspaces, cached
        tables; reserved by CUDA-graph pools, which keep their steps' temporaries)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graphs = pool_bytes(torch.cuda.memory_snapshot())["graphs"] - self.base_pools["graphs"]
        other = torch.cuda.memory_allocated() - self.base - state
        return other / 2**20, graphs / 2**20

    def start(self) -> None:
        """Open a window: its peak is measured above what is allocated now."""
        if self.cuda:
            self._fold()
            self.window_base = torch.cuda.memory_allocated()

    def window_mib(self) -> float:
        """Peak MiB of the current window above its start."""
        return (self._fold() - self.window_base) / 2**20

    def lifetime_mib(self) -> tuple[float, float]:
        """(peak MiB above the base over the whole life, MiB still reserved above it)."""
        self._fold()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved() - self.base_reserved
        return max(self.high - self.base, held) / 2**20, held / 2**20

    def _fold(self) -> int:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.high = max(self.high, peak)
        torch.cuda.reset_peak_memory_stats()
        return peak
