"""One table per section (headers, then one list of cells per row): printed as text at the end
of a run and written as markdown into RESULTS.md."""

from __future__ import annotations

from bench.formatting import fmt, spread, tf


def kernel_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "form",
        "shape",
        "cuBLAS ms",
        "triton ms",
        "triton speedup",
        "gram ms",
        "dispatch",
        "faster",
        "gram/cuBLAS",
        "never slower",
        "triton err",
        "exact sym",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["kind"], r["shape"], "ERROR " + r["error"][:60]] + [""] * 9)
            continue
        body.append(
            [
                "X X^T" if r["kind"] == "gram" else "c*AA+b*A",
                r["shape"],
                fmt(r["cublas_ms"], ".4f"),
                fmt(r.get("triton_ms"), ".4f"),
                fmt(r.get("speedup_triton"), ".2f"),
                fmt(r["gram_ms"], ".4f"),
                r["dispatch"],
                fmt(r.get("faster")),
                fmt(r["gram_vs_cublas"], ".2f"),
                fmt(r["dispatch_ok"]),
                fmt(r.get("triton_err"), ".1e"),
                fmt(r.get("triton_symmetric")),
            ]
        )
    return h, body


def ortho_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "shape",
        "variant",
        "ms",
        "TFLOP/s",
        "% of peak",
        "plain-matmul floor ms",
        "err vs fp64 loop",
        "err vs exact polar, Gaussian",
        "err vs exact polar, low rank + noise",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["shape"], r["name"], "ERROR " + r["error"][:60], *[""] * 6])
            continue
        body.append(
            [
                r["shape"],
                r["name"],
                spread(r, "ms"),
                tf(r["tflops"]),
                fmt(r["pct_peak"], ".1f"),
                fmt(r["floor_ms"]),
                fmt(r.get("err_fp64"), ".1e"),
                fmt(r.get("polar_err_gauss"), ".4f"),
                fmt(r.get("polar_err_low_rank"), ".4f"),
            ]
        )
    return h, body


def step_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "workload",
        "optimizer",
        "step ms (median)",
        "x faster than torch.optim.Muon",
        "x faster than naive",
        "first step ms",
        "note",
    ]
    body = []
    for r in rows:
        note = r.get("skipped") or (("ERROR " + r["error"][:60]) if "error" in r else "")
        if r.get("vs_fused_adamw") is not None:
            note = f"{r['vs_fused_adamw']:.2f}x fused AdamW"
        body.append(
            [
                r["workload"],
                r["name"],
                spread(r, "ms"),
                fmt(r.get("speedup_vs_torch"), ".2f"),
                fmt(r.get("speedup_vs_naive"), ".2f"),
                spread(r, "first_step_ms", ".1f"),
                note,
            ]
        )
    return h, body


def peak_over_state(r: dict) -> float | None:
    """Whole-run peak above params and grads, in units of the optimizer's own state."""
    if r.get("peak_mib") is None or not r.get("state_mib"):
        return None
    return r["peak_mib"] / r["state_mib"]


def memory_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    h = [
        "workload",
        "optimizer",
        "state MiB",
        "state B/param",
        "peak MiB above params+grads",
        "peak / state",
        "steady step peak MiB (delta)",
        "first step peak MiB (delta)",
        "kept between steps: graph pools / other MiB",
    ]
    body = []
    for r in rows:
        if "skipped" in r or "error" in r:
            continue
        body.append(
            [
                r["workload"],
                r["name"],
                fmt(r.get("state_mib"), ".1f"),
                fmt(r.get("state_bytes_per_param"), ".2f"),
                spread(r, "peak_mib", ".0f"),
                fmt(peak_over_state(r), ".2f"),
                spread(r, "step_peak_mib", ".0f"),
                spread(r, "first_step_peak_mib", ".0f"),
                f"{spread(r, 'graph_pools_mib', '.0f')} / {spread(r, 'kept_mib', '.0f')}",
            ]
        )
    return h, body


TABLES = {
    "kernels": kernel_table,
    "ortho": ortho_table,
    "step": step_table,
    "memory": memory_table,
}
"""Each section's table."""
