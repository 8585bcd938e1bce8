"""The row sum-of-squares kernel's tiles against torch's norm on GPT-125M's orthogonalized
stacks (bf16, L2 flushed between calls by do_bench), on a GPU. Prints us and TB/s per config."""

import torch
import triton
from triton.testing import do_bench

from muon_plugin.kernels import _row_factors_triton as rf


def run(X: torch.Tensor, block_c: int, tile: int, warps: int) -> torch.Tensor:
    S, m, n = X.shape
    out = torch.empty(S, m, dtype=torch.float32, device=X.device)
    block_r = max(1, tile // block_c)
    rows = S * m
    grid = (triton.cdiv(rows, block_r),)
    rf._row_sum_squares_kernel[grid](
        X, out, rows, n, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps
    )
    return out


def timed(label: str, fn, mb: float, rep: int = 200) -> None:
    t = do_bench(fn, rep=rep, return_mode="median")
    print(f"   {label:24s} {t * 1e3:.1f} us ({mb / t / 1e3:.2f} TB/s)")


def main() -> None:
    for shape in [(48, 768, 768), (12, 3072, 768), (12, 768, 3072), (144, 768, 768)]:
        X = torch.randn(shape, device="cuda").to(torch.bfloat16)
        mb = X.numel() * 2 / 1e6
        ref = X.double().square().sum(-1)
        print(f"{shape} {mb:.1f} MB")
        timed(
            "torch norm",
            lambda X=X: torch.linalg.vector_norm(X, dim=-1, dtype=torch.float32).square_(),
            mb,
        )
        timed("default", lambda X=X: rf.row_sum_squares(X), mb)
        for bc in (256, 512):
            for tile in (2048, 4096, 8192, 16384):
                for warps in (4, 8):
                    if shape[2] % bc:
                        continue
                    out = run(X, bc, tile, warps)
                    assert torch.allclose(out.double(), ref, rtol=1e-5)
                    fn = lambda X=X, bc=bc, tile=tile, warps=warps: run(X, bc, tile, warps)  # noqa: E731
                    timed(f"bc={bc} tile={tile} w={warps}", fn, mb, rep=100)


if __name__ == "__main__":
    main()
