# ruff: noqa: B023  (each closure is timed inside the loop iteration that made it)
"""Probe: batched C = A @ B in Triton with per-row sum-of-squares partials in the epilogue,
against cuBLAS bmm + the row-sum kernel, on GPT-125M's three NorMuon stacks."""

import sys

import torch
import triton
import triton.language as tl
from muon_plugin.kernels._product_triton import product_row_sums
from triton.testing import do_bench

from muon_plugin.kernels._row_factors_triton import row_sum_squares

CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
]
TMA_CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4)]


@triton.jit
def _mm_rows_tma(
    A,
    B,
    C,
    P,
    BATCH,
    M,
    N,
    K,
    NT,
    A_T: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    tiles_n = tl.cdiv(N, BN)
    tm = pid // tiles_n
    tn = pid % tiles_n
    if A_T:  # A stored as (K, M) rows
        a_desc = tl.make_tensor_descriptor(A, [BATCH, K, M], [K * M, M, 1], [1, BK, BM])
    else:
        a_desc = tl.make_tensor_descriptor(A, [BATCH, M, K], [M * K, K, 1], [1, BM, BK])
    b_desc = tl.make_tensor_descriptor(B, [BATCH, K, N], [K * N, N, 1], [1, BK, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if A_T:
            a = a_desc.load([b, k * BK, tm * BM]).reshape([BK, BM]).T
        else:
            a = a_desc.load([b, tm * BM, k * BK]).reshape([BM, BK])
        bb = b_desc.load([b, k * BK, tn * BN]).reshape([BK, BN])
        acc = tl.dot(a, bb, acc)
    out = acc.to(C.dtype.element_ty)
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    bl = b.to(tl.int64)
    tl.store(C + bl * M * N + rm[:, None] * N + rn[None, :], out, mask=mask)
    o = tl.where(mask, out.to(tl.float32), 0.0)
    tl.store(P + (bl * M + rm) * NT + tn, tl.sum(o * o, axis=1), mask=rm < M)


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def run_tma(A, Bm, cfg, a_t):
    bm, bn, bk, w, s = cfg
    batch, M, K = A.shape
    N = Bm.shape[-1]
    C = torch.empty(batch, M, N, dtype=torch.bfloat16, device=A.device)
    nt = triton.cdiv(N, bn)
    P = torch.empty(batch, M, nt, dtype=torch.float32, device=A.device)
    grid = (triton.cdiv(M, bm) * nt, batch)
    base = A.mT if a_t else A  # the contiguous storage
    _mm_rows_tma[grid](
        base, Bm, C, P, batch, M, N, K, nt, A_T=a_t, BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s
    )
    return C, P


def main():
    triton.set_allocator(_scratch)
    torch.manual_seed(0)
    dev = "cuda"
    cases = []
    Q48 = torch.randn(48, 768, 768, device=dev).to(torch.bfloat16)
    X48 = torch.randn(48, 768, 768, device=dev).to(torch.bfloat16)
    cases.append(("48x QX 768x768", Q48, X48, False))
    Q12 = torch.randn(12, 768, 768, device=dev).to(torch.bfloat16)
    X12 = torch.randn(12, 768, 3072, device=dev).to(torch.bfloat16)
    cases.append(("12x QX 768x3072", Q12, X12, False))
    cases.append(("12x XtQ 3072x768", X12.mT, Q12, True))
    total_base, total_best = 0.0, 0.0
    for name, A, Bm, a_t in cases:
        t_mm = do_bench(lambda: torch.bmm(A, Bm), warmup=50, rep=300)
        ref = torch.bmm(A, Bm)
        t_sum = do_bench(lambda: row_sum_squares(ref), warmup=50, rep=300)
        base = t_mm + t_sum
        print(
            f"{name}: cublas bmm {t_mm * 1e3:.1f} us + sums {t_sum * 1e3:.1f} us"
            f" = {base * 1e3:.1f} us"
        )
        sums = row_sum_squares(ref)
        sbuf = torch.empty_like(sums)
        best = None
        for kind in ("ptr", "tma"):
            for cfg in CONFIGS if kind == "ptr" else TMA_CONFIGS:
                try:
                    f = (
                        (lambda c=cfg: (product_row_sums(A, Bm, sbuf, tiles=c), sbuf[..., None]))
                        if kind == "ptr"
                        else (lambda c=cfg: run_tma(A, Bm, c, a_t))
                    )
                    C, P = f()
                    torch.cuda.synchronize()
                    err = ((C.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    serr = (
                        (P.sum(-1).flatten() - row_sum_squares(C).flatten()).abs().max()
                        / sums.max()
                    ).item()
                    t = do_bench(f, warmup=30, rep=200)
                except Exception as e:  # noqa: BLE001
                    print(f"  {kind} {cfg}: failed {type(e).__name__}: {str(e)[:200]}")
                    continue
                print(f"  {kind} {cfg}: {t * 1e3:.1f} us (err {err:.1e}, sums err {serr:.1e})")
                if best is None or t < best[0]:
                    best = (t, kind, cfg)
        print(
            f"  best {best[1]} {best[2]}: {best[0] * 1e3:.1f} us vs {base * 1e3:.1f} us "
            f"(gain {(base - best[0]) * 1e3:.1f} us)"
        )
        total_base += base
        total_best += best[0]
        sys.stdout.flush()
    print(
        f"total: base {total_base * 1e3:.1f} us, epilogue {total_best * 1e3:.1f} us, "
        f"gain {(total_base - total_best) * 1e3:.1f} us"
    )


if __name__ == "__main__":
    main()
