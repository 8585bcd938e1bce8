"""The closing summary of a run: one block per section that ran, with the peers' numbers
measured elsewhere beside a full GPU run's."""

from __future__ import annotations

from bench.config import Config
from bench.formatting import fmt, tf
from bench.kernels import kernel_line
from bench.ortho import ortho_line
from bench.tables import peak_over_state

# Peer numbers measured earlier on one H200, for the summary of a full GPU run (a reminder of
# the peers' order of magnitude, not a measurement of this run).
EARLIER_PEERS_MS = {
    "llama3-8b-4L": {
        "torch.optim.Muon (2.11)": 146.0,
        "naive per-parameter": 159.0,
        "fused AdamW": 7.2,
        "muonium newton_schulz": 126.0,
        "dion Muon, Triton (best)": 113.0,
    },
    "gpt-125m": {
        "torch.optim.Muon (2.11)": 37.1,
        "naive per-parameter": 51.6,
        "fused AdamW": 1.0,
        "muonium": 9.2,
        "dion Muon, torch NS (best)": 5.1,
    },
}


def summary(results: dict[str, list[dict]], peak: dict | None, meta: dict, cfg: Config) -> str:
    """The closing summary: one block per section that ran."""
    lines = [
        "",
        "=" * 100,
        f"SUMMARY  {meta['device']} | torch {meta['torch']} | triton "
        f"{meta['triton']} | sizes: {meta['sizes']}",
    ]
    if peak:
        lines.append(f"peak: {peak['name']} {tf(peak['tflops'])} TFLOP/s")
    if "kernels" in results:
        lines += summary_kernels(results["kernels"])
    if "ortho" in results:
        lines.append("\n[ortho] zeropower, 5 steps")
        lines += ["  " + ortho_line(r) for r in results["ortho"]]
    if "step" in results:
        lines += summary_step(results["step"], cfg)
    if "memory" in results:
        lines += summary_memory(results["memory"])
    lines.append("=" * 100)
    return "\n".join(lines)


def summary_kernels(rows: list[dict]) -> list[str]:
    lines = ["\n[kernels] ms: cuBLAS / triton / gram(dispatch)"]
    lines += ["  " + kernel_line(r) for r in rows]
    bad = [r for r in rows if r.get("dispatch_ok") is False]
    lines.append(
        "  dispatch never slower than cuBLAS: "
        + ("yes" if not bad else "NO at " + ", ".join(f"{r['kind']} {r['shape']}" for r in bad))
    )
    return lines


def step_summary_line(r: dict) -> str | None:
    """One ``optimizer.step()`` row of the summary (None for a skipped peer)."""
    head = f"  {r['workload']:<18} {r['name']:<30}"
    if "skipped" in r:
        return None if r["group"] == "peer" else f"{head} skipped: {r['skipped']}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:80]}"
    extra = ""
    if r.get("vs_fused_adamw") is not None:
        extra = (
            f"  = {r['vs_fused_adamw']:.2f}x fused AdamW "
            f"({'within' if r['within_2x_adamw'] else 'NOT within'} 2x)"
        )
    elif r.get("floor_ms") and r["name"] != "AdamW(fused=True)":
        extra = f"  {r['ms'] / r['floor_ms']:.2f}x the plain-matmul floor"
    return (
        f"{head} {r['ms']:9.3f}  x{fmt(r.get('speedup_vs_torch'), '.2f'):>5} / "
        f"x{fmt(r.get('speedup_vs_naive'), '.2f'):>5}{extra}"
    )


def summary_step(rows: list[dict], cfg: Config) -> list[str]:
    lines = ["\n[step] optimizer.step() median ms; x = speedup vs torch.optim.Muon / vs naive"]
    lines += [line for r in rows if (line := step_summary_line(r)) is not None]
    peers = sorted({f"{r['name']} ({r['skipped']})" for r in rows
                    if r["group"] == "peer" and "skipped" in r})  # fmt: skip
    if peers:
        lines.append("  peers skipped: " + ", ".join(peers))
    if cfg.full:
        lines += [
            f"  earlier peer figures ({wl}, one H200): "
            + ", ".join(f"{k} {v:g}" for k, v in anchors.items())
            for wl, anchors in EARLIER_PEERS_MS.items()
        ]
    floors = {r["workload"]: r.get("floor_ms") for r in rows}
    lines += [f"  {wl}: plain-matmul floor {f:.2f} ms at the measured peak"
              for wl, f in floors.items() if f]  # fmt: skip
    return lines


def summary_memory(rows: list[dict]) -> list[str]:
    lines = [
        "\n[memory] state; peak above params and grads over building and all steps "
        "(CUDA-graph pools included), also in units of the state"
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            continue
        peak_mib = r.get("peak_mib")
        lines.append(
            f"  {r['workload']:<18} {r['name']:<30} "
            f"{fmt(r.get('state_bytes_per_param'), '.2f'):>6} B/param  "
            f"{fmt(r.get('state_mib'), '.1f'):>9} MiB  peak "
            + (
                f"+{peak_mib:.0f} MiB ({fmt(peak_over_state(r), '.2f')}x state)"
                if peak_mib is not None
                else "n/a (CPU)"
            )
        )
    return lines
