"""Sections ``step`` and ``memory``: every selected row on every selected workload, its
``optimizer.step()`` timed step by step after warm-up (median), its state and memory probed;
speedups against torch's Muon and the naive reference, the elementwise part against fused
AdamW."""

from __future__ import annotations

import contextlib
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench import measure
from bench.config import Config
from bench.measure import Timer
from bench.memory import MemoryProbe, state_bytes
from bench.row import Patched, Row
from bench.rows import BF16_ROWS, optimizer_rows
from bench.workloads import Workload, make_workload, workload_specs

MEMORY_FIELDS = (
    "state_mib",
    "state_bytes_per_param",
    "peak_mib",
    "held_mib",
    "step_peak_mib",
    "first_step_peak_mib",
    "kept_mib",
    "graph_pools_mib",
    "skipped",
    "error",
    "required",
)
"""The fields of a row's measurement that its ``memory`` section entry keeps."""


def _steps(out: dict, opt: torch.optim.Optimizer, wl: Workload, cfg: Config, timer: Timer,
           probe: MemoryProbe, timed: bool, mem: bool) -> None:  # fmt: skip
    """Step ``opt``: first step, warm-up, timed steps, one probed steady step; fills ``out``."""
    probe.start()
    out["first_step_ms"] = timer.wall(opt.step)
    if timer.cuda:
        out["first_step_peak_mib"] = probe.window_mib()
    for _ in range(cfg.step_warmup - 1):
        opt.step()
    timer.sync()
    if timed:
        times = [timer.time_step(opt.step) for _ in range(wl.iters)]
        out["ms"] = statistics.median(times)
        out["min_ms"] = min(times)
        out["iters"] = len(times)
    if mem or timed:
        sb = state_bytes(opt)
        out["state_mib"] = sb / 2**20
        out["state_bytes_per_param"] = sb / wl.n_params
    if mem and timer.cuda:
        probe.start()
        opt.step()
        out["step_peak_mib"] = probe.window_mib()
        out["kept_mib"], out["graph_pools_mib"] = probe.kept_mib(state_bytes(opt))
        out["peak_mib"], out["held_mib"] = probe.lifetime_mib()


def run_row(row: Row, wl: Workload, cfg: Config, timer: Timer, timed: bool, mem: bool) -> dict:
    out: dict[str, Any] = {"workload": wl.name, "name": row.name, "group": row.group}
    if row.skip:
        out["skipped"] = row.skip
        return out
    opt = None
    try:
        with contextlib.ExitStack() as stack:
            patched = stack.enter_context(row.context()) if row.context else None
            if patched is not None and not isinstance(patched, Patched):
                raise TypeError(f"the row's context yields {type(patched).__name__}, not Patched")
            probe = MemoryProbe(timer.cuda)
            opt = row.make(wl.params)
            _steps(out, opt, wl, cfg, timer, probe, timed, mem)
            if patched is not None:
                patched.verify(timer.cuda)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        if row.group != "peer":
            traceback.print_exc()
    finally:
        del opt
        measure.free_memory()
    return out


def add_ratios(rows: list[dict]) -> None:
    by = {r["name"]: r for r in rows}
    ref_torch = by.get("torch.optim.Muon", {}).get("ms")
    ref_naive = by.get("naive reference Muon", {}).get("ms")
    adamw = by.get("AdamW(fused=True)", {}).get("ms")
    for r in rows:
        if r.get("ms") is None:
            continue
        r["speedup_vs_torch"] = ref_torch / r["ms"] if ref_torch else None
        r["speedup_vs_naive"] = ref_naive / r["ms"] if ref_naive else None
        if r["name"] == "MuonForeach elementwise only" and adamw:
            r["vs_fused_adamw"] = r["ms"] / adamw
            r["within_2x_adamw"] = r["ms"] <= 2.0 * adamw


def workload_entries(rows: list[dict], timed: bool, mem: bool) -> tuple[list[dict], list[dict]]:
    """The step and memory section entries of one workload's rows (their ratios added, or
    updated when more rows came since)."""
    add_ratios(rows)
    step_rows: list[dict] = []
    mem_rows: list[dict] = []
    for r in rows:
        base = {k: r[k] for k in ("workload", "name", "group") if k in r}
        if timed:
            step_rows.append({"section": "step", **r})
        if mem:
            m = {"section": "memory", **base}
            for k in MEMORY_FIELDS:
                if k in r:
                    m[k] = r[k]
            mem_rows.append(m)
    return step_rows, mem_rows


def _raise_recompile_limit() -> None:
    """Dynamo's recompile limits raised to at least 64, for the compiled row."""
    with contextlib.suppress(Exception):
        from torch._dynamo import config as dynamo_config

        for attr in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, attr):
                setattr(dynamo_config, attr, max(64, getattr(dynamo_config, attr)))


def section_step(
    cfg: Config,
    device: torch.device,
    timer: Timer,
    peak: dict | None,
    timed: bool,
    mem: bool,
    log,
    saved: Callable[[list[dict], list[dict]], None] = lambda step, mem: None,
) -> tuple[list[dict], list[dict]]:
    """Every selected row on every selected workload; ``saved(step_rows, mem_rows)`` after
    each row with everything measured so far (``--json`` keeps a partial file)."""
    if cfg.compile_row:
        _raise_recompile_limit()
    step_rows: list[dict] = []
    mem_rows: list[dict] = []
    for spec in workload_specs(cfg):
        if spec.key not in cfg.select.workloads:
            continue
        wl = make_workload(spec.name, spec.shapes, device, spec.iters, spec.dtype)
        floor = (wl.flops / (peak["tflops"] * 1e9)) if peak else None
        log(
            f"  workload {wl.name}: {len(wl.params)} matrices, {wl.n_params / 1e6:.1f} M params, "
            f"{wl.flops / 1e12:.3f} TFLOP per Muon step"
            + (f", plain-matmul floor {floor:.2f} ms" if floor else "")
        )
        rows: list[dict] = []
        done_step: list[dict] = []
        done_mem: list[dict] = []
        for row in optimizer_rows(cfg):
            if (spec.dtype != torch.float32 and row.name not in BF16_ROWS) or not cfg.select.takes(
                row.name
            ):
                continue
            if cfg.select.expired():
                row = Row(row.name, row.group, None, skip="time budget (--budget) spent")
            r = run_row(row, wl, cfg, timer, timed, mem)
            r["required"] = row.required
            r["n_params"] = wl.n_params
            r["n_matrices"] = len(wl.params)
            r["floor_ms"] = floor
            rows.append(r)
            log("    " + step_line(r))
            done_step, done_mem = workload_entries(rows, timed, mem)
            saved(step_rows + done_step, mem_rows + done_mem)
        step_rows += done_step
        mem_rows += done_mem
        del wl
        measure.free_memory()
    return step_rows, mem_rows


def step_line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['name']:<30} skipped: {r['skipped']}"
    if "error" in r:
        return f"{r['name']:<30} ERROR {r['error'][:100]}"
    parts = [f"{r['name']:<30}"]
    if "ms" in r:
        parts.append(f"{r['ms']:9.3f} ms (min {r['min_ms']:.3f})")
    parts.append(f"first step {r['first_step_ms']:9.1f} ms")
    if "state_bytes_per_param" in r:
        parts.append(f"state {r['state_bytes_per_param']:.2f} B/param")
    if "peak_mib" in r:
        parts.append(f"peak +{r['peak_mib']:.0f} MiB")
    if "graph_pools_mib" in r:
        parts.append(f"kept: graph pools {r['graph_pools_mib']:.0f}, other {r['kept_mib']:.0f} MiB")
    return "  ".join(parts)
