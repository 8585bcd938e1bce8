"""Fused / structure-aware kernels for the Muon optimizer (Triton optional).

The lowest layer above :mod:`muon_plugin.defaults`: nothing here imports the orthogonalization
or the distributed plan.
"""

from muon_plugin.kernels.symmetric import (
    baddbmm,
    bmm,
    gram,
    kernel_handles,
    symmetric_matmul,
    tma_enabled,
    tma_supported,
    triton_available,
    triton_kernels_enabled,
    use_symmetric_kernel,
)

__all__ = [
    "baddbmm",
    "bmm",
    "gram",
    "kernel_handles",
    "symmetric_matmul",
    "tma_enabled",
    "tma_supported",
    "triton_available",
    "triton_kernels_enabled",
    "use_symmetric_kernel",
]
