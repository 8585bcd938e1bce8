"""Section ``ortho``: ``zeropower`` per strategy (polar_express, newton_schulz; 5 steps;
turbo_muon, 4 steps), ms and achieved TFLOP/s (plain-matmul count) against the bf16 matmul peak
of the run; accuracy: relative distance to the fp64 iteration and to the exact polar factor on
a Gaussian and on a low-rank-plus-noise input, each path checked against the plain bf16 loop
(never farther from the polar factor)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench import measure
from bench.accuracy import exact_polar, float64_loop, low_rank_plus_noise
from bench.config import Config, fmt_shape, scale_shape
from bench.formatting import tf
from bench.kernels import symmetric_kernel
from bench.measure import Timer, ns_flops, rel_err
from bench.reference import naive_newton_schulz
from muon_plugin import zeropower
from muon_plugin.orthogonalize import use_gram_iteration

ORTHO_SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336), (8, 1024, 1024)]

TURBO = "turbo_muon x4"
"""Turbo-Muon (AOL row scaling, its fitted quintics) at its 4 steps; it approximates the polar
factor of the row-scaled matrix (docs/design/turbo_aol.md)."""

PLAIN_LOOP = "polar_express, plain bf16 loop"
"""The plain bf16 loop (``backend="plain"``: x-space, bf16 products on cuBLAS): the accuracy
every fast path must keep."""

Loop = tuple[str, int]
"""(strategy, steps): the fp64 loop a variant computes."""


def ortho_variants(G: torch.Tensor, use_triton: bool) -> list[tuple[str, Callable, Loop]]:
    """(name, fn of the input, the fp64 loop it computes) for one input shape: the default
    path, Newton-Schulz, Turbo-Muon's 4 steps, the plain bf16 loop (``backend="plain"``), the
    default path on cuBLAS alone (``backend="cublas"``, where the Gram-space path runs, which
    is cuBLAS-only otherwise), the naive reference. Each path is chosen by its backend's name,
    as a user chooses it."""
    variants: list[tuple[str, Callable[[torch.Tensor], Any], Loop]] = [
        ("polar_express", lambda X: zeropower(X, 5, "polar_express"), ("polar_express", 5)),
        ("newton_schulz", lambda X: zeropower(X, 5, "newton_schulz"), ("newton_schulz", 5)),
        (TURBO, lambda X: zeropower(X, 4, "turbo_muon"), ("turbo_muon", 4)),
        (
            PLAIN_LOOP,
            lambda X: zeropower(X, 5, "polar_express", backend="plain"),
            ("polar_express", 5),
        ),
    ]
    if use_triton and use_gram_iteration(G.reshape(-1, *G.shape[-2:]).to(torch.bfloat16)):
        variants.append(
            (
                "polar_express, cuBLAS only",
                lambda X: zeropower(X, 5, "polar_express", backend="cublas"),
                ("polar_express", 5),
            )
        )
    naive = ("newton_schulz", 5)
    variants.append(("naive eager NS (reference)", lambda X: naive_newton_schulz(X, 5), naive))
    return variants


def section_ortho(cfg: Config, device: torch.device, timer: Timer, peak: dict, log) -> list[dict]:
    _, use_triton, _ = symmetric_kernel()
    use_triton = use_triton and device.type == "cuda"
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for shape in (scale_shape(s, cfg.div) for s in ORTHO_SHAPES):
        G = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)  # fp32, as
        variants = ortho_variants(G, use_triton)  # the optimizer hands over momentum directions
        refs = {loop: float64_loop(G, *loop) for *_, loop in variants}
        L = low_rank_plus_noise(shape, gen, device)
        polar = {"gauss": exact_polar(G), "low_rank": exact_polar(L)}
        for name, fn, loop in variants:
            flops = ns_flops(shape, loop[1])
            row: dict[str, Any] = {"section": "ortho", "shape": fmt_shape(shape), "name": name}
            try:
                ms = timer.bench(lambda fn=fn, G=G: fn(G))
                row["err_fp64"] = rel_err(fn(G), refs[loop])
                row["polar_err_gauss"] = rel_err(fn(G), polar["gauss"])
                row["polar_err_low_rank"] = rel_err(fn(L), polar["low_rank"])
                row.update(ms=ms, tflops=flops / ms * 1e-9, flops=flops)
                row["pct_peak"] = 100.0 * row["tflops"] / peak["tflops"]
                row["floor_ms"] = flops / (peak["tflops"] * 1e9)
            except Exception as e:
                row["error"] = repr(e)
                traceback.print_exc()
            rows.append(row)
            log("  " + ortho_line(row))
        check_accuracy(rows, fmt_shape(shape), log)
        del G, L, refs, polar
        measure.free_memory()
    return rows


def check_accuracy(rows: list[dict], shape: str, log) -> None:
    """Mark each polar_express row whose distance to the exact polar factor exceeds the plain
    bf16 loop's (by more than 1%, the spread of bf16 rounding between runs)."""
    mine = [r for r in rows if r["shape"] == shape and "error" not in r]
    plain = next((r for r in mine if r["name"] == PLAIN_LOOP), None)
    if plain is None:
        return
    for r in mine:
        if not r["name"].startswith("polar_express"):
            continue
        r["as_accurate_as_plain"] = all(
            r[k] <= plain[k] * 1.01 for k in ("polar_err_gauss", "polar_err_low_rank")
        )
        if not r["as_accurate_as_plain"]:
            log(f"  ! {shape} {r['name']}: farther from the exact polar factor than the plain loop")


def ortho_line(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:>14} {r['name']:<28} ERROR {r['error'][:90]}"
    return (
        f"{r['shape']:>14} {r['name']:<28} {r['ms']:9.3f} ms  {tf(r['tflops']):>7} TFLOP/s  "
        f"{r['pct_peak']:5.1f}% of peak (floor {r['floor_ms']:.3f} ms)  "
        f"err vs fp64 loop {r.get('err_fp64', float('nan')):.2e}  vs exact polar: gauss "
        f"{r.get('polar_err_gauss', float('nan')):.4f}, low rank "
        f"{r.get('polar_err_low_rank', float('nan')):.4f}"
    )
