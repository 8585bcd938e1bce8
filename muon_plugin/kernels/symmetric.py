"""Symmetric products ``alpha * X @ X.mT + beta * C`` for the Newton-Schulz / Polar Express step.

Each Muon orthogonalization step on X (B, m, n), m <= n, computes ``A = X @ X.mT`` and
``B = b*A + c*(A @ A)``; both are products of a matrix with its own transpose, whose result
is symmetric. The Triton kernel computes only the upper-triangle tiles and mirrors them,
halving the FLOPs; ``gram`` picks it where it beats cuBLAS and falls back to torch elsewhere.

Which product runs where is a caller's choice: ``gram(..., kernel=True/False, tma=...)`` does
what it is told (the orthogonalization backends resolve it once per shape group, see
:mod:`muon_plugin.orthogonalize.backends`). Left at ``None`` (direct calls), ``kernel`` is
decided by :func:`kernel_handles` and ``tma`` by :func:`tma_enabled`, which read
``MUON_PLUGIN_DISABLE_TRITON`` and ``MUON_PLUGIN_SYRK_TMA`` at that call.

Triton is optional: it is imported lazily, and ``import muon_plugin.kernels`` never fails.
"""

from __future__ import annotations

import functools
import math
import os
from types import ModuleType

import torch

from muon_plugin.kernels.symmetric_tiles import upper_tile_count

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

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_LAUNCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def triton_available() -> bool:
    """True if triton imports (any import failure counts as unavailable); cached."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _triton_module() -> ModuleType:
    """The kernel module, imported on first use (triton.jit runs at that point)."""
    if not triton_available():
        raise RuntimeError("symmetric_matmul needs triton, which could not be imported")
    from muon_plugin.kernels import _symmetric_triton

    return _symmetric_triton


# The kernel's programs: 128 x 128 upper-triangle tiles, two resident per SM: the region pays
# where they fill the GPU (min_tiles: twice its SM count).
_TILE = 128
_PROGRAMS_PER_SM = 2
# The SM count of the GPUs the region was measured on (H100 / H200 SXM): the rule's answer
# where no GPU is there to ask (a plan resolved for a CPU device, the tests).
REFERENCE_SMS = 132
# Tiles times reduction length below which cuBLAS wins (launch cost, short main loops).
_MIN_TILE_WORK = 2**20
# Inside a CUDA graph the kernel takes the products from this m up (see use_symmetric_kernel;
# m = 768 is the smallest size measured so).
GRAPHED_MIN_M = 768


@functools.cache
def sm_count(device: torch.device | None = None) -> int:
    """The SM count of CUDA ``device`` (:data:`REFERENCE_SMS` for None, a CPU device, or
    without CUDA)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return REFERENCE_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_symmetric_kernel(
    m: int, k: int, batch: int = 1, graphed: bool = False, device: torch.device | None = None
) -> bool:
    """Whether the Triton kernel is expected to beat cuBLAS for X of shape (batch, m, k).

    The kernel does half the FLOPs at a lower per-FLOP rate than cuBLAS and launches more
    slowly, so it pays where its tiles fill the GPU (two programs per SM) and each has a long
    enough reduction. Measured on an H200 (bf16, eager, ``do_bench``, ``X X^T`` / with the
    ``c A A + b A`` epilogue where k = m): it wins at (4096, 14336) 1.76x, (8, 4096, 4096)
    1.81x / 1.56x, (8, 2048, 2048) 1.32x / 1.23x, (4, 2048, 2048) 1.15x / 1.15x, (16, 1024,
    4096) 1.26x, (8, 1024, 4096) 1.08x, (2, 2048, 8192) 1.19x, (32, 1024, 1024) 1.10x / 1.01x;
    cuBLAS wins at (2048, 2048) 0.38x, (1024, 4096) 0.74x, (1024, 65536) 0.61x (too few
    tiles), (8, 1024, 1024) 0.88x, (16, 1024, 1024) 0.94x (too little work per launch).

    ``graphed``: the products are replayed from a CUDA graph, where launch cost is gone
    (eager stacks, one-off calls and per-unit plans included, keep the region below). Then
    the kernel also takes every product with ``GRAPHED_MIN_M <= m < 1024``, whatever its tile
    count: a GPT-125M step (stacks of 48 x 768 x 768, 12 x 768 x 3072 and 12 x 3072 x 768)
    was faster this way than with those products on cuBLAS in every H100 run (three runs:
    median 4.474 against 4.742 ms, ``scripts/benchmark.py``). Re-tune with
    ``scripts/bench_kernels.py`` and the benchmark's "cuBLAS below m = 1024" row.

    ``device``: the GPU it runs on, whose SM count the tiles must fill (``sm_count``).
    """
    if graphed and GRAPHED_MIN_M <= m < 1024:
        return True
    tiles = batch * upper_tile_count(m, _TILE, _TILE)
    min_tiles = _PROGRAMS_PER_SM * sm_count(device)
    return m >= 1024 and tiles >= min_tiles and tiles * k >= _MIN_TILE_WORK


def _flatten(X: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """View X (..., m, k) as 3-D (B, m, k); also return the leading batch shape."""
    if X.dim() < 2:
        raise ValueError(f"expected a tensor of at least 2 dims, got shape {tuple(X.shape)}")
    return X.reshape(-1, *X.shape[-2:]), tuple(X.shape[:-2])


def _check_c(C: torch.Tensor, X: torch.Tensor) -> None:
    m = X.shape[-2]
    if C.shape[-2:] != (m, m) or C.dim() > X.dim():
        raise ValueError(f"C has shape {tuple(C.shape)}, expected (..., {m}, {m})")
    if C.get_device() != X.get_device():  # cheaper than comparing .device objects
        raise ValueError(f"C is on {C.device}, X on {X.device}")


def symmetric_matmul(
    X: torch.Tensor,
    *,
    Y: torch.Tensor | None = None,
    alpha: float = 1.0,
    C: torch.Tensor | None = None,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
    gamma: float = 0.0,
    out_dtype: torch.dtype | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """``alpha * X @ Y.mT + beta * C (+ gamma * I)`` with the Triton kernel; X is (..., m, k).

    ``Y`` (same shape and dtype as X) defaults to X; otherwise the caller guarantees that
    ``X @ Y.mT`` is symmetric (e.g. two commuting symmetric matrices). Accumulates in fp32
    and returns ``out_dtype`` (default X.dtype). Only upper-triangle tiles are computed and
    then mirrored, so the output is exactly symmetric. C, if given, is (..., m, m) (broadcast
    over the batch) and is taken as symmetric: only its upper triangle is read. ``out`` must
    not overlap X, Y or C. Needs a GPU that Triton supports, or TRITON_INTERPRET=1 set before
    the first call (then CPU tensors work, slowly). ``tma`` allows the TMA-load kernel on
    Hopper where the operands qualify (default: :func:`tma_enabled`).
    """
    if X.dtype not in _LAUNCH_DTYPES:
        raise TypeError(f"symmetric_matmul supports bf16/fp16/fp32, got {X.dtype}")
    if Y is not None and (Y.shape != X.shape or Y.dtype != X.dtype or Y.device != X.device):
        raise ValueError(
            f"Y must match X: got Y {tuple(Y.shape)} {Y.dtype} on {Y.device}, "
            f"X {tuple(X.shape)} {X.dtype} on {X.device}"
        )
    out_dtype = out_dtype or X.dtype
    if out_dtype not in _LAUNCH_DTYPES:
        raise TypeError(f"symmetric_matmul writes bf16/fp16/fp32, got out_dtype={out_dtype}")
    mod = _triton_module()
    if not (X.is_cuda or mod.INTERPRET):
        raise RuntimeError(
            "symmetric_matmul needs a CUDA tensor (or TRITON_INTERPRET=1 for the CPU)"
        )
    if X.dim() < 2:
        raise ValueError(f"expected a tensor of at least 2 dims, got shape {tuple(X.shape)}")
    m, k = X.shape[-2:]
    out_shape = (*X.shape[:-1], m)
    X3 = X if X.dim() == 3 else X.reshape(-1, m, k)
    Y3 = None if Y is None else (Y if Y.dim() == 3 else Y.reshape(-1, m, k))

    C3 = None
    if C is not None:
        _check_c(C, X)
        # A C with fewer dims broadcasts over the batch (stride 0, no copy).
        C3 = C if C.dim() == 3 == X.dim() else C.expand(out_shape).reshape(-1, m, m)

    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=X.device)
    else:
        if tuple(out.shape) != out_shape or out.dtype != out_dtype or out.device != X.device:
            raise ValueError(
                f"out must be {out_shape} {out_dtype} on {X.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        out_ptr = out.untyped_storage().data_ptr()
        for name, t in (("X", X), ("Y", Y), ("C", C)):
            if t is not None and t.untyped_storage().data_ptr() == out_ptr:
                raise ValueError(f"out must not share memory with {name}")
    if out.numel():  # k == 0 is fine: the kernel's loop does not run, leaving beta * C
        out3 = out if out.dim() == 3 else out.view(-1, m, m)
        tma = tma_enabled() if tma is None else tma
        mod.launch(X3, C3, out3, alpha, beta, gamma=gamma, Y=Y3, tma=tma)
    return out


def _torch_gram(
    X: torch.Tensor, Y: torch.Tensor, alpha: float, C: torch.Tensor | None, beta: float
) -> torch.Tensor:
    """The cuBLAS / CPU path: same shapes and dtypes as the kernel.

    2-D and 3-D inputs go straight to one ``mm``/``bmm``/``addmm``/``baddbmm`` (no reshapes:
    on small, launch-bound shapes every extra op shows in the step time). bf16 on the CPU runs
    in fp32 (:func:`widen_on_cpu`), as does fp16.
    """
    if widen_on_cpu(X):
        C32 = None if C is None else C.float()
        return _torch_gram(X.float(), Y.float(), alpha, C32, beta).to(X.dtype)
    if X.dim() <= 3:
        if C is None and alpha == 1:
            return X @ Y.mT
        if C is None:
            C, beta = X.new_empty(*X.shape[:-1], X.shape[-2]), 0.0
        if X.dim() == 2:
            return torch.addmm(C, X, Y.mT, beta=beta, alpha=alpha)
        if C.dim() == 2:
            C = C.expand(X.shape[0], *C.shape)
        return torch.baddbmm(C, X, Y.mT, beta=beta, alpha=alpha)
    X3, lead = _flatten(X)
    Y3 = Y.reshape(X3.shape)
    m = X3.shape[1]
    C3 = None if C is None else C.expand(*lead, m, m).reshape(-1, m, m)
    return _torch_gram(X3, Y3, alpha, C3, beta).view(*lead, m, m)


def widen_on_cpu(X: torch.Tensor) -> bool:
    """Whether a product of ``X`` runs on fp32 copies of its operands: bf16 or fp16 on the CPU.

    The same arithmetic as a half-precision product summed in fp32 (each product of two bf16
    or fp16 numbers is exact in fp32; only the order of the sums may differ), rounded once,
    but on fp32 matmul units: CPUs without native bf16 matmuls (most x86 ones before
    AVX512-BF16 / AMX) emulate bf16 about 16x slower than fp32. The copies cost ``O(mn)``
    beside the ``O(m^2 n)`` product.
    """
    return X.is_cpu and X.dtype in _KERNEL_DTYPES


def baddbmm(
    C: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, *, beta: float, alpha: float
) -> torch.Tensor:
    """``beta * C + alpha * X @ Y`` for 3-D batches, rounded once to ``X``'s dtype: one
    ``torch.baddbmm``, on fp32 copies where :func:`widen_on_cpu`."""
    if widen_on_cpu(X):
        out = torch.baddbmm(C.float(), X.float(), Y.float(), beta=beta, alpha=alpha)
        return out.to(X.dtype)
    return torch.baddbmm(C, X, Y, beta=beta, alpha=alpha)


def bmm(X: torch.Tensor, Y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``X @ Y`` for 3-D batches (into ``out`` if given), in ``X``'s dtype: one ``torch.bmm``,
    on fp32 copies where :func:`widen_on_cpu`."""
    if not widen_on_cpu(X):
        return torch.bmm(X, Y, out=out)
    product = torch.bmm(X.float(), Y.float()).to(X.dtype)
    return product if out is None else out.copy_(product)


def triton_kernels_enabled() -> bool:
    """Triton is importable and not switched off with MUON_PLUGIN_DISABLE_TRITON=1 (read now)."""
    return os.environ.get("MUON_PLUGIN_DISABLE_TRITON", "0") != "1" and triton_available()


def tma_enabled() -> bool:
    """The TMA-load kernel is not switched off with MUON_PLUGIN_SYRK_TMA=0 (read now)."""
    return os.environ.get("MUON_PLUGIN_SYRK_TMA", "1") != "0"


def tma_supported(device: torch.device) -> bool:
    """Whether ``device`` is a GPU with TMA (Hopper or newer); False without CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def kernel_handles(X: torch.Tensor) -> bool:
    """Whether ``gram(X)`` runs the Triton kernel (bf16/fp16 CUDA, in the region it wins)."""
    return (
        X.is_cuda
        and X.dtype in _KERNEL_DTYPES
        and X.dim() >= 2
        and triton_kernels_enabled()
        and use_symmetric_kernel(X.shape[-2], X.shape[-1], math.prod(X.shape[:-2]), device=X.device)
    )


def gram(
    X: torch.Tensor,
    *,
    Y: torch.Tensor | None = None,
    alpha: float = 1.0,
    C: torch.Tensor | None = None,
    beta: float = 0.0,
    gamma: float = 0.0,
    out_dtype: torch.dtype | None = None,
    kernel: bool | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """``alpha * X @ Y.mT + beta * C + gamma * I`` for X (..., m, k); the optimizer's entry point.

    ``Y`` defaults to X; a given ``Y`` must make ``X @ Y.mT`` symmetric (the kernel computes
    only the upper triangle). Uses the Triton kernel (see ``symmetric_matmul``; C must then be
    symmetric) where ``kernel_handles(X)``: bf16/fp16 CUDA tensors in the shape region where it
    beats cuBLAS (``use_symmetric_kernel``), unless triton is missing or
    MUON_PLUGIN_DISABLE_TRITON=1; the kernel sums everything in fp32 and rounds once to
    ``out_dtype``. Otherwise ``torch`` matmuls (cuBLAS): an ``out_dtype`` other than X's is
    reached through an fp32 product (one rounding, as in the kernel); in X's own dtype the
    product is one ``baddbmm`` (one rounding) and ``gamma * I`` is added to it after (a
    second rounding, of the diagonal only). Returns (..., m, m).

    ``kernel`` (True: the Triton kernel, False: torch) overrides that choice, and ``tma``
    allows the kernel's TMA loads (see ``symmetric_matmul``): callers that resolved their path
    once pass both, so nothing is decided (and no environment variable read) per product.
    """
    if C is not None:
        _check_c(C, X)
    if kernel_handles(X) if kernel is None else kernel:
        return symmetric_matmul(
            X, Y=Y, alpha=alpha, C=C, beta=beta, gamma=gamma, out_dtype=out_dtype, tma=tma
        )
    Y = X if Y is None else Y
    if out_dtype in (None, X.dtype):
        out = _torch_gram(X, Y, alpha, C, beta)
    else:
        out = _product_fp32(X, Y)
        if alpha != 1.0:
            out.mul_(alpha)
        if C is not None:
            out.add_(C, alpha=beta)
    if gamma != 0.0:
        out.diagonal(dim1=-2, dim2=-1).add_(gamma)
    return out if out_dtype in (None, out.dtype) else out.to(out_dtype)


def _product_fp32(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``X @ Y.mT`` accumulated and returned in fp32 (tensor cores for bf16/fp16 on CUDA)."""
    f32 = torch.float32
    if X.is_cuda and X.dtype in _KERNEL_DTYPES and X.dim() in (2, 3):
        mm = torch.mm if X.dim() == 2 else torch.bmm
        return mm(X, Y.mT, out_dtype=f32)
    return X.to(f32) @ Y.to(f32).mT
