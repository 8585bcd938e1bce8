#!/usr/bin/env python
"""Check and time the symmetric-product Triton kernel against cuBLAS (GPU only).

For each shape (bf16) it checks ``symmetric_matmul(X)`` against an fp32 ``X @ X.mT``
(relative Frobenius error, exact symmetry, every element written), and the epilogue form
``alpha * A @ A.mT + beta * A`` on the square symmetric A that the Newton-Schulz step uses;
then times both against the torch/cuBLAS path with ``triton.testing.do_bench`` (median,
warm-up excluded, several input sets rotated so small shapes are not L2 resident), and
prints what ``gram`` dispatches to and whether that choice is the faster one.

    python scripts/bench_kernels.py [--json rows.json] [--shapes 4096x4096,8x2048x2048]

On a machine without a CUDA GPU (or without triton) it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muon_plugin.kernels import symmetric as S  # noqa: E402

DEFAULT_SHAPES = [
    (4096, 4096),
    (4096, 14336),
    (1024, 4096),
    (2048, 8192),
    (32, 1024, 1024),
    (8, 2048, 2048),
    (128, 256, 256),
    (14336, 4096),  # tall: Muon transposes these first, so skipped
]
# Quintic Newton-Schulz coefficients (a, b, c): B = b*A + c*A@A.
NS_B, NS_C = -4.7750, 2.0315
TOL = 1e-2


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",") if s]


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def make_inputs(shape: tuple[int, ...], n: int) -> list[torch.Tensor]:
    k = shape[-1]
    # Scaled so X @ X.mT has O(1) entries, as after Muon's normalization.
    return [
        torch.randn(shape, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(n)
    ]


def make_sym(X: torch.Tensor) -> torch.Tensor:
    A = X.float() @ X.float().mT
    return ((A + A.mT) * 0.5).to(torch.bfloat16)  # exactly symmetric


def n_sets(nbytes: int, l2_bytes: int) -> int:
    """Enough input sets that one rotation overflows L2 three times over (at most 32)."""
    return max(1, min(32, math.ceil(3 * l2_bytes / max(nbytes, 1))))


def bench(fn, inputs: list[tuple], do_bench) -> float:
    """Median ms of fn over rotating input sets (do_bench flushes L2 and drops warm-up)."""
    it = itertools.cycle(inputs)
    return do_bench(lambda: fn(*next(it)), warmup=25, rep=100, return_mode="median")


def bench_graph(fn, inputs: list[tuple]) -> float | None:
    """Ms per call replayed from a CUDA graph: GPU time alone, without launch overhead."""
    import triton.testing

    it = itertools.cycle(inputs)
    try:
        return triton.testing.do_bench_cudagraph(lambda: fn(*next(it)), rep=50)
    except Exception as e:  # graph capture can fail on odd setups; the eager time still stands
        print(f"    (graph timing failed: {e!r})")
        return None


def run_case(kind: str, shape, inputs, do_bench, mod) -> dict:
    """kind 'gram': X (..., m, k) -> X X^T; kind 'epilogue': A (..., m, m) -> c A A^T + b A."""
    X0 = inputs[0][0]
    m, k = X0.shape[-2:]
    batch = math.prod(X0.shape[:-2])
    if kind == "gram":
        alpha, beta = 1.0, 0.0
        argsets = [(x, None) for (x,) in inputs]
        ref = X0.float() @ X0.float().mT
    else:
        alpha, beta = NS_C, NS_B
        argsets = [(x, x) for (x,) in inputs]
        ref = alpha * (X0.float() @ X0.float().mT) + beta * X0.float()

    def triton_fn(X, C):
        return S.symmetric_matmul(X, alpha=alpha, C=C, beta=beta)

    def torch_fn(X, C):
        return S._torch_gram(X, X, alpha, C, beta)

    # Correctness (this call also autotunes); the output is poisoned first.
    out = torch.full((*X0.shape[:-1], m), float("nan"), device="cuda", dtype=X0.dtype)
    S.symmetric_matmul(X0, alpha=alpha, C=argsets[0][1], beta=beta, out=out)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    err_torch = rel_err(torch_fn(*argsets[0]), ref)
    all_written = bool(torch.isfinite(out).all().item())
    symmetric = bool(torch.equal(out, out.mT))
    ok = err < TOL and all_written and symmetric
    cfg = mod.best_config(X0, has_c=kind != "gram")
    del out, ref

    t_torch = bench(torch_fn, argsets, do_bench)
    t_triton = bench(triton_fn, argsets, do_bench)
    g_torch = bench_graph(torch_fn, argsets)
    g_triton = bench_graph(triton_fn, argsets)
    flops = 2.0 * batch * m * m * k  # full-product FLOPs, for both
    pick = "triton" if S.use_symmetric_kernel(m, k, batch) else "cublas"
    faster = "triton" if t_triton < t_torch else "cublas"
    return {
        "shape": fmt_shape(shape),
        "kind": kind,
        "batch": batch,
        "m": m,
        "k": k,
        "cublas_ms": t_torch,
        "triton_ms": t_triton,
        "speedup": t_torch / t_triton,
        "graph_cublas_ms": g_torch,
        "graph_triton_ms": g_triton,
        "graph_speedup": g_torch / g_triton if g_torch and g_triton else None,
        "cublas_tflops": flops / t_torch * 1e-9,
        "triton_tflops_equiv": flops / t_triton * 1e-9,
        "dispatch": pick,
        "faster": faster,
        "dispatch_ok": pick == faster,
        "rel_err": err,
        "rel_err_cublas": err_torch,
        "exact_symmetric": symmetric,
        "all_written": all_written,
        "correct": ok,
        "best_config": str(cfg) if cfg is not None else None,
        "n_input_sets": len(inputs),
    }


def sweep(shapes, do_bench, mod, l2: int) -> list[dict]:
    """Time every autotune config on each shape (X @ X.mT), to re-tune the config list."""
    configs = mod._configs(mod.POINTER_TILES)
    results = []
    for shape in shapes:
        m, k = shape[-2:]
        xs = make_inputs(shape, n_sets(math.prod(shape) * 2, l2))
        X3s = [(x.reshape(-1, m, k),) for x in xs]
        ref = X3s[0][0].float() @ X3s[0][0].float().mT
        out = torch.empty(X3s[0][0].shape[0], m, m, device="cuda", dtype=torch.bfloat16)
        t_cublas = bench(lambda x: S._torch_gram(x, x, 1.0, None, 0.0), X3s, do_bench)
        line = [f"{fmt_shape(shape):>14}: cublas {t_cublas:.4f}"]
        for cfg in configs:
            d = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            name = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**d)
            try:
                out.fill_(float("nan"))
                mod.launch(X3s[0][0], None, out, 1.0, 0.0, config=d)
                err = rel_err(out, ref)
                ok = err < TOL and bool(torch.equal(out, out.mT))
                t = bench(lambda x, d=d, o=out: mod.launch(x, None, o, 1.0, 0.0, d), X3s, do_bench)
            except Exception as e:  # e.g. out of shared memory
                t, ok, err = float("inf"), False, repr(e)[:80]
            results.append(
                {
                    "shape": fmt_shape(shape),
                    "config": name,
                    "ms": t,
                    "cublas_ms": t_cublas,
                    "ok": ok,
                    "err": err,
                }
            )
            line.append(f"{name:>22}: {t:.4f}{'' if ok else ' BAD ' + str(err)}")
        print("\n    ".join(line), flush=True)
        del xs, X3s, out, ref
        torch.cuda.empty_cache()
    return results


def odd_checks(mod) -> bool:
    """Every config on awkward inputs: m, k not block multiples, transposed X, fp16, C."""
    cases = [
        ("1000x3000", lambda: torch.randn(1000, 3000, device="cuda"), False),
        ("(2x1000x300).mT", lambda: torch.randn(2, 1000, 300, device="cuda").mT, False),
        ("4000x4104 +C", lambda: torch.randn(4000, 4104, device="cuda"), True),
        ("3x130x70 fp16", lambda: torch.randn(3, 130, 70, device="cuda"), True),
    ]
    all_ok = True
    for name, make, with_c in cases:
        dtype = torch.float16 if "fp16" in name else torch.bfloat16
        X = (make() / math.sqrt(1000)).to(dtype)
        X3 = X.reshape(-1, *X.shape[-2:]) if X.dim() != 3 else X
        m = X3.shape[1]
        ref = X3.float() @ X3.float().mT
        C = None
        if with_c:
            C = make_sym(torch.randn(X3.shape[0], m, 64, device="cuda").to(dtype))
            ref = NS_C * ref + NS_B * C.float()
        bad = []
        for cfg in mod._configs(mod.POINTER_TILES):
            d = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            out = torch.full((X3.shape[0], m, m), float("nan"), device="cuda", dtype=dtype)
            try:
                mod.launch(X3, C, out, NS_C if with_c else 1.0, NS_B if with_c else 0.0, d)
                err = rel_err(out, ref)
                if not (err < TOL and torch.isfinite(out).all() and torch.equal(out, out.mT)):
                    bad.append(f"{d}: err {err:.2e}")
            except Exception as e:
                if "OutOfResources" not in type(e).__name__:
                    bad.append(f"{d}: {e!r}"[:200])
        all_ok &= not bad
        print(f"  odd shape {name:>16}: {'ok' if not bad else 'FAILED ' + '; '.join(bad)}")
    return all_ok


def time_shapes(args, mod, l2: int, do_bench) -> tuple[list[dict], bool]:
    """The timing rows of every shape and kind (``X X^T``, and ``A A^T + C`` unless
    ``--no-epilogue``), printed as they come; True when any check failed."""
    failed = False
    rows: list[dict] = []
    for shape in args.shapes or DEFAULT_SHAPES:
        m, k = shape[-2:]
        if m > k:
            print(f"{fmt_shape(shape)}: skipped (tall, m > k: Muon transposes it first)",
                  flush=True)  # fmt: skip
            rows.append({"shape": fmt_shape(shape), "skipped": "tall"})
            continue
        for kind in ["gram"] if args.no_epilogue else ["gram", "epilogue"]:
            row = time_case(kind, shape, mod, l2, do_bench)
            failed |= not row.get("correct", False)
            rows.append(row)
            detail = (
                f"cublas {row['cublas_ms']:.4f} ms, triton {row['triton_ms']:.4f} ms, "
                f"err {row['rel_err']:.2e}, ok={row['correct']}"
                if "error" not in row
                else f"ERROR {row['error']}"
            )
            print(f"  {row['shape']:>14} {kind:>8}: {detail}", flush=True)
            torch.cuda.empty_cache()
    return rows, failed


def time_case(kind: str, shape: tuple[int, ...], mod, l2: int, do_bench) -> dict:
    """One row: cuBLAS against the kernel on rotating input sets (an error becomes a row)."""
    m = shape[-2]
    try:
        in_shape = shape if kind == "gram" else (*shape[:-1], m)
        xs = make_inputs(shape, n_sets(math.prod(in_shape) * 2, l2))
        if kind == "epilogue":
            xs = [make_sym(x) for x in xs]
        return run_case(kind, shape, [(x,) for x in xs], do_bench, mod)
    except Exception as e:  # keep going: one bad shape should not hide the rest
        return {"shape": fmt_shape(shape), "kind": kind, "error": repr(e), "correct": False}


def print_table(rows: list[dict]) -> None:
    """The summary table and the best autotune configs."""
    hdr = (
        f"{'shape':>14} {'kind':>8} {'cuBLAS ms':>10} {'triton ms':>10} {'speedup':>8} "
        f"{'graph x':>7} {'cuBLAS TF':>9} {'dispatch':>8} {'right?':>6} {'err':>8} {'sym':>4}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "skipped" in r:
            print(f"{r['shape']:>14} {'':>8} skipped ({r['skipped']})")
        elif "error" in r:
            print(f"{r['shape']:>14} {r['kind']:>8} ERROR {r['error'][:80]}")
        else:
            gx = f"{r['graph_speedup']:.2f}x" if r["graph_speedup"] else "n/a"
            print(
                f"{r['shape']:>14} {r['kind']:>8} {r['cublas_ms']:>10.4f} {r['triton_ms']:>10.4f} "
                f"{r['speedup']:>7.2f}x {gx:>7} {r['cublas_tflops']:>9.0f} "
                f"{r['dispatch']:>8} {'yes' if r['dispatch_ok'] else 'NO':>6} "
                f"{r['rel_err']:>8.1e} {'yes' if r['exact_symmetric'] else 'NO':>4}"
            )
    print(
        "speedup = cuBLAS / triton, eager (do_bench median, launch overhead included); "
        "graph x = the same from CUDA-graph replays (GPU time only)"
    )
    print("\nbest autotune configs:")
    for r in rows:
        if r.get("best_config"):
            print(f"  {r['shape']:>14} {r['kind']:>8}: {r['best_config']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the rows to this JSON file")
    p.add_argument(
        "--shapes", type=parse_shapes, help="comma-separated, e.g. 4096x4096,8x2048x2048"
    )
    p.add_argument("--no-epilogue", action="store_true", help="skip the A @ A.mT + C rows")
    p.add_argument(
        "--sweep", action="store_true", help="time every kernel config per shape (for re-tuning)"
    )
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU available; nothing to benchmark.")
        return 0
    if not S.triton_available():
        print("bench_kernels: triton is not importable; nothing to benchmark.")
        return 0
    import triton
    import triton.testing

    from muon_plugin.kernels import _symmetric_triton as mod

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; "
        f"torch {torch.__version__}, triton {triton.__version__}",
        flush=True,
    )

    if args.sweep:
        shapes = [sh for sh in args.shapes or DEFAULT_SHAPES if sh[-2] <= sh[-1]]
        res = sweep(shapes, triton.testing.do_bench, mod, l2)
        if args.json:
            args.json.write_text(json.dumps({"sweep": res}, indent=1))
        return 0 if all(r["ok"] for r in res if r["ms"] != float("inf")) else 1

    print("correctness of every config on awkward shapes:", flush=True)
    odd_ok = odd_checks(mod)
    t0 = time.time()
    rows, failed = time_shapes(args, mod, l2, triton.testing.do_bench)
    print(f"\n(total {time.time() - t0:.1f} s; ms are medians; cuBLAS TF counts 2*m*m*k)")
    print_table(rows)
    if args.json:
        meta = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    if failed or not odd_ok:
        print("SOME CHECKS FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
