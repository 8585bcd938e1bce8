#!/usr/bin/env python
"""What QK-Clip costs a step: the max-logit statistic and the clip, on the Llama-3-8B shape.

Rows (medians; GPU: CUDA events, CPU: wall clock):

1. ``attention fwd+bwd``: one layer's SDPA (causal, GQA) forward and backward, bf16, the
   reference the statistic is compared with;
2. ``statistic``: :func:`muon_plugin.qk_clip.max_logit_per_head` on that layer's q and k, by
   each of its paths: FlexAttention's fused forward with ``max_scores`` (CUDA) and the chunked
   ``q k^T`` with fp32 products (no softmax, no ``P V``, no backward);
3. ``clip``: :meth:`muon_plugin.qk_clip.QKClip.step` for ``--layers`` layers' ``wq`` / ``wk``
   (fp32, as FSDP keeps them): the factors and one multiply per parameter, no communication
   (one process);
4. ``model step``: a whole training step (forward, backward, ``MuonForeach`` step) of
   torchtitan's llama3 at the benchmark flavor ``bench_8b_4l`` (Llama-3-8B layers, 4 of them,
   ``configs/llama3_bench_model.py``; bf16 autocast, fp32 parameters), without QK-Clip
   and with it (every attention call recorded, the clip after every step), and the ratio.

    .venv/bin/python scripts/bench_qk_clip.py                      # GPU, prints
    .venv/bin/python scripts/bench_qk_clip.py --results RESULTS.md # GPU, writes its section
    .venv/bin/python scripts/bench_qk_clip.py --quick              # CPU smoke run (tiny shapes)

``--results`` puts the table between ``<!-- bench_qk_clip:start -->`` and
``<!-- bench_qk_clip:end -->``, with the date, the device and torch's version.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/
from results_md import write_section  # noqa: E402

import muon_plugin.qk_clip.logits as logits  # noqa: E402
from muon_plugin.qk_clip import (  # noqa: E402
    QKClip,
    Visibility,
    max_logit_per_head,
    separate_projections,
)

FULL = dict(batch=1, seq=8192, dim=4096, heads=32, kv_heads=8, layers=4, flavor="bench_8b_4l")
NAN = float("nan")
QUICK = dict(batch=1, seq=128, dim=256, heads=8, kv_heads=8, layers=2, flavor="bench_tiny")


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> dict:
    """``{"ms": median, "min": .., "max": ..}`` of ``fn()`` over ``reps`` calls (ms) after two
    warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "min": min(times), "max": max(times)}


def attention_rows(shape: dict, device: torch.device, reps: int) -> list[dict]:
    b, seq, h, hkv = shape["batch"], shape["seq"], shape["heads"], shape["kv_heads"]
    d = shape["dim"] // h
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def heads_view(heads: int) -> Tensor:
        """``[B, heads, L, D]`` as the model hands it over: ``[B, L, heads, D]`` transposed."""
        x = torch.randn(b, seq, heads, d, device=device, dtype=dtype, generator=g)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = heads_view(h), heads_view(hkv), heads_view(hkv)

    def attention() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv < h)
        out.sum().backward()

    def statistic(flex: bool) -> None:
        max_logit_per_head(q.detach(), k.detach(), visible=Visibility(causal=True), flex=flex)

    att = timed(attention, device, reps)
    rows = [show({"row": "attention fwd+bwd (SDPA, one layer)", **att})]
    for path, flex in (("FlexAttention path", True), ("chunked path", False)):
        logits._flex_state.pop("failed", None)
        if flex and not logits._flex_available(q, flex):
            rows.append(show({"row": f"statistic, {path}: not available here", "ms": NAN}))
            continue
        stat = timed(lambda flex=flex: statistic(flex), device, reps)
        if flex and logits._flex_state.get("failed"):
            rows.append(show({"row": f"statistic, {path}: failed (see the warning)", "ms": NAN}))
            continue
        name = f"statistic (max logit per head, one layer), {path}"
        rows.append(show({"row": name, **stat, "ratio": stat["ms"] / att["ms"]}))
    return rows


def clip_row(shape: dict, device: torch.device, reps: int) -> dict:
    h, hkv, dim, n = shape["heads"], shape["kv_heads"], shape["dim"], shape["layers"]
    d = dim // h
    layers = []
    for i in range(n):
        wq = torch.nn.Parameter(torch.randn(h * d, dim, device=device))
        wk = torch.nn.Parameter(torch.randn(hkv * d, dim, device=device))
        layers.append(separate_projections(f"layers.{i}", ("wq", wq), ("wk", wk), h, hkv, d))
    clip = QKClip(layers, tau=1.0)

    def step() -> None:
        for i in range(n):
            clip.record_max(i, torch.full((h,), 2.0, device=device))  # every head clips
        clip.step()

    return show({"row": f"clip after the step ({n} layers' wq, wk)", **timed(step, device, reps)})


def model_rows(shape: dict, device: torch.device, reps: int) -> list[dict]:
    """Training steps of torchtitan's llama3 at the benchmark flavor, QK-Clip off and on."""
    try:
        import torchtitan.protocols.train_spec as tt_spec
        from torchtitan.config import JobConfig

        import configs.llama3_bench_model as bench_model
    except ImportError as e:
        return [show({"row": f"model step: skipped ({e})", "ms": NAN})]
    from muon_plugin import MuonForeach
    from muon_plugin.adapter.qk_clip import build_qk_clip
    from muon_plugin.param_groups.options import MuonConfig
    from muon_plugin.torchtitan.qk_clip import describe_attention

    spec = tt_spec.get_train_spec(bench_model.NAME)
    args = model_args(spec, shape, JobConfig())
    results = []
    for qk_clip in (False, True):
        torch.manual_seed(0)
        with torch.device(device):
            model = spec.model_cls(args)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        tokens = torch.randint(0, args.vocab_size, (shape["batch"], shape["seq"]), device=device)
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        opt = MuonForeach([{"params": matrices}, {"params": others, "algorithm": "adamw"}], lr=1e-4)
        if qk_clip:
            clip = build_qk_clip([model], MuonConfig(qk_clip_tau=100.0), describe_attention, None)
            opt.register_step_post_hook(lambda *a, clip=clip: clip.step())
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

        def step(model=model, opt=opt, tokens=tokens, dtype=dtype) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        name = "model step, QK-Clip on" if qk_clip else "model step, QK-Clip off"
        results.append(show({"row": f"{name} ({shape['flavor']})", **timed(step, device, reps)}))
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results[1]["ratio"] = results[1]["ms"] / results[0]["ms"]
    return results


def line(r: dict) -> str:
    """A row of the table."""
    ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
    spread = f"{r['min']:.3f}-{r['max']:.3f}" if "min" in r else "-"
    return f"| {r['row']} | {r['ms']:.3f} | {spread} | {ratio} |"


def show(row: dict) -> dict:
    """Print ``row`` as soon as it is measured (a later row that fails loses nothing)."""
    print(line(row), flush=True)
    return row


def model_args(spec: Any, shape: dict, job: Any) -> Any:
    """The flavor's model args for the shape's sequence length (the rotary table's length)."""
    args = spec.model_args[shape["flavor"]]
    job.training.seq_len = shape["seq"]
    args.update_from_config(job)
    return args


def table(rows: list[dict]) -> str:
    lines = ["| row | ms (median) | min-max | ratio |", "| --- | --- | --- | --- |"]
    return "\n".join(lines + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    shape = QUICK if args.quick or device.type == "cpu" else FULL
    reps = args.reps or (3 if device.type == "cpu" else 20)
    rows = attention_rows(shape, device, reps)
    rows.append(clip_row(shape, device, reps))
    rows += model_rows(shape, device, max(2, reps // 2))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    meta = (
        f"{datetime.date.today().isoformat()}, {name}, torch {torch.__version__}; batch "
        f"{shape['batch']} x seq {shape['seq']}, dim {shape['dim']}, {shape['heads']} heads "
        f"({shape['kv_heads']} key heads), {shape['layers']} layers"
    )
    text = table(rows)
    print(meta)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.results:
        body = "\n".join(
            [
                "## QK-Clip cost (scripts/bench_qk_clip.py)",
                "",
                meta + ".",
                "",
                "The statistic row's ratio is to the attention's forward + backward; the model "
                "row's ratio is the step with QK-Clip over the step without.",
                "",
                text,
            ]
        )
        write_section(args.results, "bench_qk_clip", body)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
