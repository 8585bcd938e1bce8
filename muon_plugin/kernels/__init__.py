"""Fused / structure-aware kernels for the Muon optimizer (Triton optional)."""

from muon_plugin.kernels.symmetric import (
    gram,
    kernel_handles,
    symmetric_matmul,
    triton_available,
    use_symmetric_kernel,
)

__all__ = ["gram", "kernel_handles", "symmetric_matmul", "triton_available", "use_symmetric_kernel"]
