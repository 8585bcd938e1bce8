"""Run torchtitan 0.2.2 on a machine without an accelerator (CPU processes talking over gloo).

Out of the box torchtitan falls back to ``device_type = "cuda"`` when no accelerator is found
(``torchtitan.tools.utils.get_device_info``) and several modules copy ``device_type`` and
``device_module`` into their own namespace at import time. :func:`apply` (called when
``muon_plugin.torchtitan`` is imported, i.e. while torchtitan parses the job config and before
the ``Trainer`` exists) does, only when no accelerator is present:

1. rebinds ``device_type = "cpu"`` and ``device_module`` (a small stand-in for ``torch.cuda``,
   :data:`cpu_device_module`) in ``torchtitan.tools.utils`` and in every already imported
   ``torchtitan`` module that holds a copy of the originals (``distributed.utils`` then picks
   the ``gloo`` backend, ``distributed.parallel_dims`` builds CPU meshes,
   ``components.metrics`` / ``tools.profiling`` stop calling into CUDA). ``get_device_info`` is
   replaced too, so modules imported later (the model packages, ``distributed.dual_pipe_v``) see
   the CPU values whether they copy the attributes or call the function;
2. makes FSDP2 use plain ``SUM`` reductions on CPU meshes: torchtitan sets a gradient divide
   factor, for which FSDP2 picks ``ReduceOp.PREMUL_SUM``, which gloo rejects;
3. lets the MoE router count tokens per expert on CPU: ``torchtitan.models.moe.moe`` calls
   ``torch.histc`` on integer expert indices, which only CUDA implements; that module's
   ``torch`` global is replaced by a proxy whose ``histc`` counts integer CPU inputs in
   float32 (exact below 2**24 tokens) and returns the input dtype, like CUDA.

On a machine with an accelerator nothing is changed. :func:`apply` is idempotent. Users need
it (the README's main job runs on CPUs with it), and it has to reach into torchtitan's
modules: torchtitan 0.2.2 has no public way to run without an accelerator.
"""

from __future__ import annotations

import functools
import importlib
import os
import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["accelerator_available", "apply", "cpu_device_module", "is_applied"]

_applied = False


def accelerator_available() -> bool:
    """Whether torch sees an accelerator torchtitan could use (cuda, xpu, mps, mtia ...)."""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux (bytes on macOS); good enough for a log line.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class _CPUMemory:
    """``torch.cuda.memory`` stand-in: memory snapshots do not exist on CPU."""

    def _record_memory_history(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "profiling.enable_memory_snapshot needs a CUDA device; it is not available on CPU"
        )

    _snapshot = _record_memory_history


class _CPUDeviceModule:
    """The subset of ``torch.cuda``'s interface that torchtitan calls, answered for the CPU.

    Anything not defined here is looked up on ``torch.cpu``.
    """

    memory = _CPUMemory()

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def synchronize(self, device: Any = None) -> None:
        pass

    def is_available(self) -> bool:
        return True

    def get_device_name(self, device: Any = None) -> str:
        import platform

        return f"CPU ({platform.processor() or platform.machine()})"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(
            name=self.get_device_name(device),
            total_memory=_total_memory_bytes(),
        )

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def __repr__(self) -> str:
        return "<muon_plugin CPU stand-in for torch.cuda>"


cpu_device_module = _CPUDeviceModule()


def is_applied() -> bool:
    """Whether :func:`apply` switched torchtitan to the CPU in this process."""
    return _applied


def _rebind_copies(old_type: Any, old_module: Any) -> list[str]:
    """Rebind ``device_type``/``device_module`` in every loaded torchtitan module holding the
    original objects (and ``__main__``, for scripts that copied them)."""
    rebound = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            if name != "__main__":
                continue
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        changed = False
        if namespace.get("device_module") is old_module and old_module is not None:
            module.device_module = cpu_device_module
            changed = True
        if namespace.get("device_type") == old_type and isinstance(old_type, str):
            module.device_type = "cpu"
            changed = True
        if changed:
            rebound.append(name)
    return rebound


def _patch_memory_monitor_default() -> None:
    metrics = sys.modules.get("torchtitan.components.metrics")
    monitor = getattr(metrics, "DeviceMemoryMonitor", None)
    init = getattr(monitor, "__init__", None)
    defaults = getattr(init, "__defaults__", None)
    if defaults and isinstance(defaults[0], str) and not defaults[0].startswith("cpu"):
        init.__defaults__ = ("cpu:0",) + tuple(defaults[1:])


def _patch_fsdp_sum_reduction() -> None:
    """Force SUM (+ a post-division) instead of PREMUL_SUM/AVG for FSDP2 on CPU meshes."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors
    if getattr(original, "_muon_plugin_cpu", False):
        return

    @functools.wraps(original)
    def _get_gradient_divide_factors(*args: Any, **kwargs: Any):
        # signature: (reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
        #             factor=None, force_sum_reduction_for_comms=False)
        device_type = kwargs.get("device_type", args[3] if len(args) > 3 else "")
        if device_type == "cpu":
            if len(args) > 5:
                args = args[:5] + (True,) + args[6:]
            else:
                kwargs["force_sum_reduction_for_comms"] = True
        return original(*args, **kwargs)

    _get_gradient_divide_factors._muon_plugin_cpu = True  # type: ignore[attr-defined]
    collectives._get_gradient_divide_factors = _get_gradient_divide_factors


class _TorchWithIntegerHistc:
    """``torch`` for one module, with ``histc`` accepting integer CPU tensors."""

    def histc(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.device.type == "cpu" and not input.is_floating_point():
            return torch.histc(input.float(), *args, **kwargs).to(input.dtype)
        return torch.histc(input, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_moe_histc() -> None:
    try:
        from torchtitan.models.moe import moe
    except ImportError:  # pragma: no cover - layout of another torchtitan version
        return
    if getattr(moe, "torch", None) is torch:
        moe.torch = _TorchWithIntegerHistc()


_COPYING_MODULES = (
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)
"""Modules that copy ``device_type`` / ``device_module`` from ``tools.utils`` at import."""

# What torchtitan assumes for a device it does not know (tools/utils.py), used for MFU only.
CPU_PEAK_FLOPS = 312e12


def apply() -> bool:
    """Switch torchtitan to CPU + gloo when no accelerator is present.

    Returns True when the CPU mode is (now) active, False when an accelerator exists and
    nothing was changed. Safe to call more than once.
    """
    global _applied
    if _applied:
        # Modules imported since the first call copy the patched values from tools.utils.
        return True
    if accelerator_available():
        return False

    from torchtitan.tools import utils as tt_utils

    old_type, old_module = tt_utils.device_type, tt_utils.device_module
    if old_type == "cpu":
        _applied = True
        return True

    tt_utils.get_device_info = lambda: ("cpu", cpu_device_module)
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_device_module
    # The GPU peak-FLOPs lookup (for MFU) shells out to lspci, which fails with PermissionError
    # when PATH holds an unreadable folder (a non-root user under `su`); it means nothing on a
    # CPU anyway. torchtitan's own fallback value for unknown devices is kept.
    tt_utils.get_peak_flops = lambda device_name: CPU_PEAK_FLOPS
    # Import the modules that copy the values now, so that the rebinding below reaches them
    # even when this runs before torchtitan.train imported them.
    # (torchtitan 0.3 has no tools.profiling: the modules that exist are imported.)
    for name in _COPYING_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            pass

    _rebind_copies(old_type, old_module)
    _patch_memory_monitor_default()
    _patch_fsdp_sum_reduction()
    _patch_moe_histc()
    _applied = True
    return True
