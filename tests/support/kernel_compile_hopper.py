"""Every Triton kernel of the package compiled for a Hopper GPU (sm_90), on a machine without one.

Run by ``tests/kernels/test_kernels_compile.py`` in a subprocess (it replaces Triton's active
driver for the whole process); prints ``OK``. Triton's interpreter runs a kernel's Python, so it
passes code the GPU compiler refuses (a non-constexpr global read in a kernel did): here a
stand-in driver reports an sm_90 target, and each launch of the package's own launchers (the
arguments and constexprs they really pass, CPU tensors in place of CUDA ones) compiles the
kernel through Triton's whole pipeline down to a cubin instead of running it. Importing this
module runs nothing.
"""

from __future__ import annotations

import torch


def use_a_hopper_that_launches_nothing() -> list[str]:
    """Make every kernel launch compile for sm_90 and return; the list of compiled kernels."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, jit

    class Hopper:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def is_active(self) -> bool:
            return True

    driver.set_active(Hopper())
    run = jit.JITFunction.run
    compiled: list[str] = []

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        assert kernel is not None and kernel.asm.get("cubin"), self.fn.__name__
        compiled.append(self.fn.__name__)
        return kernel

    jit.JITFunction.run = compile_only
    return compiled


def elementwise() -> None:
    from muon_plugin.kernels import _elementwise_triton as ew

    for grad_dtype, buf_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
        for nesterov in (True, False):
            grads = [torch.zeros(64, 96, dtype=grad_dtype), torch.zeros(5000, dtype=grad_dtype)]
            ew.grouped_momentum(
                grads, [torch.zeros(g.shape, dtype=buf_dtype) for g in grads], 0.9, nesterov
            )
    for p_dtype in (torch.float32, torch.bfloat16):
        params = [torch.zeros(64, 96, dtype=p_dtype), torch.zeros(32, 128, dtype=p_dtype)]
        updates = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
        for cautious in (True, False):
            ew.grouped_decay_update(params, updates, 0.01, 0.1, cautious)
        ew.grouped_decay_update(params, updates, 0.01, 0.0, False)
        factors = [torch.ones(p.shape[0]) for p in params]
        ew.grouped_decay_update(params, updates, 0.01, 0.1, False, factors)  # runs of 8
        odd = [torch.zeros(8, 100, dtype=p_dtype)]  # rows of 100: a factor per element
        ew.grouped_decay_update(odd, [u.bfloat16() for u in odd], 0.01, 0.1, False, [torch.ones(8)])


def quantized() -> None:
    """Every constexpr value at least once (not every combination)."""
    from muon_plugin.kernels import _quantized_triton as qt
    from muon_plugin.lp.int4 import scale_tables

    cases = [
        (torch.float32, True, 256, 16, torch.bfloat16),
        (torch.bfloat16, False, 4096, 256, torch.float32),
        (torch.float32, False, 256, 2, torch.bfloat16),
    ]
    for grad_dtype, nesterov, int8_block, int4_block, direction in cases:
        grad = torch.zeros(4, 4096, dtype=grad_dtype)
        codes, scales = torch.zeros(4, 4096, dtype=torch.uint8), torch.zeros(4, 4096 // int8_block)
        qt.grouped_int8_momentum(
            [codes], [scales], [grad], torch.zeros(256), 0.9, nesterov, direction
        )
        state = (
            torch.zeros(4, 2048, dtype=torch.uint8),
            torch.zeros(4, 4096 // int4_block, dtype=torch.uint8),
            torch.zeros(4, 4096 // (16 * int4_block), dtype=torch.bfloat16),
        )
        tables = scale_tables(grad.device)
        qt.grouped_int4_momentum(*([t] for t in state), [grad], *tables, 0.9, nesterov, direction)


def row_factors_and_scaling() -> None:
    from muon_plugin.kernels import _row_factors_triton as rf
    from muon_plugin.kernels import _scale_triton as sc

    for frobenius in (True, False):
        rf.row_factors_(
            torch.ones(3, 64), torch.ones(3, 64), [(0, 64, 1.0)], 96, 0.95, 1e-8, frobenius
        )
    for dtype, cols in ((torch.bfloat16, 768), (torch.float32, 300)):
        rf.row_sum_squares(torch.zeros(3, 64, cols, dtype=dtype))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        X = torch.zeros(3, 64, 96, dtype=dtype)
        sc.scale_matrices_(X, torch.ones(3), None, 126)
        sc.scale_matrices_(X, torch.ones(3), (0.5, 2.0), 126)


def symmetric() -> None:
    """Both kernels at their largest and smallest tiles, with and without C and the identity."""
    from muon_plugin.kernels import _symmetric_triton as sy

    sy.tma_eligible = lambda X, Y: True  # CPU tensors stand in for aligned CUDA ones
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    for tiles in (sy.POINTER_TILES, sy.TMA_TILES):
        tma = tiles is sy.TMA_TILES
        for tile, dtype in ((tiles[0], torch.bfloat16), (tiles[-1], torch.float16)):
            config = dict(zip(keys, tile, strict=True))
            X = torch.zeros(2, 256, 512, dtype=dtype)
            C = torch.zeros(2, 256, 256, dtype=dtype)
            out = torch.zeros(2, 256, 256, dtype=dtype)
            sy.launch(X, None, out, 1.0, 0.0, config=config, tma=tma)
            sy.launch(X, C, out, 1.0, 0.5, config=config, gamma=1.0, tma=tma)
    config = dict(zip(keys, sy.POINTER_TILES[-1], strict=True))
    X = torch.zeros(1, 128, 256)  # fp32 in: the pointer kernel, tf32 products
    sy.launch(X, None, torch.zeros(1, 128, 128), 1.0, 0.0, config=config)


def main() -> None:
    compiled = use_a_hopper_that_launches_nothing()
    elementwise()
    quantized()
    row_factors_and_scaling()
    symmetric()
    expected = {
        "_grouped_momentum_kernel", "_grouped_decay_update_kernel", "_grouped_int8_momentum_kernel",
        "_grouped_int4_momentum_kernel", "_row_factors_kernel", "_row_sum_squares_kernel",
        "_scale_matrices_kernel",
        "_syrk_kernel", "_syrk_tma_kernel",
    }  # fmt: skip
    assert set(compiled) == expected, sorted(expected ^ set(compiled))
    print(f"OK: {len(compiled)} launches compiled for sm_90")


if __name__ == "__main__":
    main()
