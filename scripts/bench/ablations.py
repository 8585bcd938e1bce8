"""The patches our ablation rows run under: each replaces one decision or stage of the step
(its calls counted, see :class:`bench.row.Patched`) to time the step without it."""

from __future__ import annotations

import contextlib

import torch

from bench.row import Patched, row_patch


def cublas_below_m(min_m: int) -> contextlib.AbstractContextManager[Patched]:
    """The plans built inside leave every product with m < ``min_m`` to cuBLAS, CUDA-graphed
    or not (an ablation of the kernel's wider region inside graphs)."""
    from muon_plugin.orthogonalize import paths

    rule = paths.kernel_wins
    return row_patch(
        paths,
        "kernel_wins",
        lambda m, k, batch=1, graphed=False, device=None: (
            m >= min_m and rule(m, k, batch, device=device)
        ),
        on_cpu=False,  # asked only where the Triton kernel could run
    )


def torch_matrix_scaling() -> contextlib.AbstractContextManager[Patched]:
    """The per-matrix scalings of the orthogonalization (pre-scaling, folded norms) as torch
    ops instead of the Triton kernel (an ablation; the same results)."""
    from muon_plugin.kernels import matrix_scale

    return row_patch(matrix_scale, "_use_kernel", lambda X, kernel: False)


def identity_orthogonalization() -> contextlib.AbstractContextManager[Patched]:
    """Replace the plan's orthogonalization by a bf16 cast: what is left is the elementwise step."""
    from muon_plugin.distributed import plan as plan_mod

    def run(self, directions, phase=None):
        return [None if d is None else d.to(torch.bfloat16) for d in directions]

    return row_patch(plan_mod.OrthogonalizationPlan, "run", run)
