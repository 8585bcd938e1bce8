# ruff: noqa: B023  (each closure is timed inside the loop iteration that made it)
"""Probe: the rows' sums of squares of GPT-125M's three NorMuon stacks (bf16), tile sweep of the
row-sum kernel's shape (block_c, block_r, warps, stages) against the landed configuration and a
plain read (torch.sum in fp32) as the bandwidth reference. Timed in CUDA graphs. Writes the best
rule (one config per column count) to argv[1] as JSON."""

import itertools
import json
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from muon_plugin.kernels._row_factors_triton import _row_sum_squares_kernel as _k

SHAPES = [(48, 768, 768), (12, 768, 3072), (12, 3072, 768)]


def bench(fn):
    return do_bench_cudagraph(fn, rep=60) * 1e3  # us


def main():
    out_path = sys.argv[1]
    torch.manual_seed(0)
    per_cols = {}
    for s in SHAPES:
        X = torch.randn(s, device="cuda").bfloat16()
        mats, m, cols = s
        rows = mats * m
        ref = X.float().pow(2).sum(-1).reshape(-1)
        out = torch.empty(rows, device="cuda")
        mb = X.numel() * 2 / 1e6
        t_read = bench(lambda: X.sum(dtype=torch.float32))
        print(f"{s}: {mb:.1f} MB; torch.sum read {t_read:.1f} us ({mb / t_read:.2f} TB/s)")
        results = []
        for bc, tile, warps, stages in itertools.product(
            (256, 512, 1024), (2048, 4096, 8192, 16384), (4, 8, 16), (3,)
        ):
            br = tile // bc
            if br < 1 or warps * 32 * 2 > tile:
                continue

            def fn(br=br, bc=bc, warps=warps, stages=stages):
                _k[(triton.cdiv(rows, br),)](
                    X, out, rows, cols, BLOCK_R=br, BLOCK_C=bc, num_warps=warps, num_stages=stages
                )

            try:
                fn()
                torch.cuda.synchronize()
                err = (out - ref).abs().max().item() / ref.abs().max().item()
                t = bench(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  {bc} {tile} {warps} {stages}: failed {type(e).__name__}")
                continue
            results.append((t, bc, tile, warps, stages, err))
        results.sort()
        landed = [r for r in results if r[1] == 256 and r[2] == 2048 and r[3] == 4 and r[4] == 3]
        if landed:
            t = landed[0][0]
            print(f"  landed (256, 2048, 4 warps, 3 stages): {t:.1f} us ({mb / t:.2f} TB/s)")
        for t, bc, tile, warps, stages, err in results[:8]:
            print(
                f"  block_c {bc} tile {tile} warps {warps} stages {stages}: {t:.1f} us "
                f"({mb / t:.2f} TB/s) err {err:.1e}"
            )
        totals = per_cols.setdefault(str(cols), {})
        for t, bc, tile, warps, stages, _ in results:
            key = (bc, tile // bc, warps, stages)
            totals[key] = totals.get(key, 0.0) + t
    # one config per column count: the least total time over the shapes with those columns
    best_rule = {}
    for cols, totals in per_cols.items():
        key = min(totals, key=totals.get)
        best_rule[cols] = list(key)
        print(f"cols {cols}: best {key} total {totals[key]:.1f} us")
    with open(out_path, "w") as f:
        json.dump(best_rule, f)
    print("rule", best_rule)


if __name__ == "__main__":
    main()
