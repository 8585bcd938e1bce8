"""The symmetric kernel's grid: the upper-triangle tiles of an ``m x m`` output.

Shared, without Triton, by the kernel's launch (:mod:`muon_plugin.kernels._symmetric_triton`:
one program per tile) and the rule that decides where the kernel runs
(:func:`muon_plugin.kernels.symmetric.use_symmetric_kernel`), so that neither module imports
the other's.
"""

from __future__ import annotations


def upper_tile_count(m: int, block_m: int, block_n: int) -> int:
    """Tiles of ``block_m x block_n`` (block_n a multiple of block_m) that meet the upper
    triangle of an ``m x m`` output: the kernel's programs per matrix."""
    t = -(-m // block_n)
    return (block_n // block_m) * t * (t + 1) // 2
