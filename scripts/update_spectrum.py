#!/usr/bin/env python
"""Largest singular value of Muon's update through the optimizer's whole step, per backend.

An orthogonalized update has its singular values near 1 (Polar Express x5 ends at most about
1.13 above its smallest ones); a path that let them grow step after step would make a run
diverge however small its learning rate. ``scripts/polar_accuracy.py`` measures the iteration
alone (``zeropower``); this runs ``MuonForeach.step()`` itself, so the plan's phases, its CUDA
graphs (replayed step after step), the Triton kernels and the update kernel are all on the path.

The parameters have the shapes of the convergence benchmark's 88M llama3 (48 x 768x768,
24 x 2048x768, 12 x 768x2048; ``--div`` divides every dimension), start at zero and take lr 1,
no weight decay and ``lr_adjust="none"``, so each step's update is the orthogonalized
direction itself; the momentum is the optimizer's default (0.95, Nesterov), so its kernels and
buffers are on the path too (``--momentum 0``: the direction is the gradient). The gradients
cycle through inputs that stress the normalization and the iteration: Gaussian, exactly rank
one, rank one plus noise, singular values decaying as i^-2, one singular value 1e4 times the
others, and a rank-one gradient of 1e-6 (with momentum, each direction also carries the earlier
ones). Per backend, shape and input: the largest singular value (power iteration on the update,
every matrix of the stack) over all steps, and whether every update was finite.

    python scripts/update_spectrum.py [--backends auto,eager,auto:no-gram,auto:no-triton,plain]
        [--steps 30] [--momentum 0.95] [--div 1] [--device auto|cpu|cuda] [--limit 1.25]
        [--json out.json]

Exit status 1 when a backend's update is non-finite or its largest singular value exceeds
``--limit``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from muon_plugin import MuonForeach  # noqa: E402

SHAPES = ((48, (768, 768)), (24, (2048, 768)), (12, (768, 2048)))
"""(count, shape) of the convergence benchmark model's Muon matrices."""
INPUTS = ("gauss", "rank1", "rank1+noise", "decay2", "spike", "tiny")
BACKENDS = "auto,eager,auto:no-gram,auto:no-triton,plain"


def stress_input(kind: str, batch: int, m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A ``(batch, m, n)`` gradient of the input ``kind`` (see the module docstring)."""
    dev = gen.device

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen)

    if kind == "gauss":
        return randn(batch, m, n)
    outer = randn(batch, m, 1) @ randn(batch, 1, n)
    if kind == "rank1":
        return outer
    if kind == "rank1+noise":
        return outer + 1e-3 * randn(batch, m, n)
    if kind == "tiny":
        return 1e-6 * outer
    r = min(m, n)
    left = torch.linalg.qr(randn(batch, m, r))[0]
    right = torch.linalg.qr(randn(batch, n, r))[0]
    if kind == "decay2":
        sv = torch.arange(1, r + 1, device=dev, dtype=torch.float32) ** -2
    elif kind == "spike":
        sv = torch.ones(r, device=dev)
        sv[0] = 1e4
    else:
        raise ValueError(f"unknown input {kind!r}; expected one of {INPUTS}")
    return (left * sv) @ right.mT


def largest_singular_value(U: torch.Tensor, gen: torch.Generator, iters: int = 30) -> torch.Tensor:
    """Per matrix of the stack ``U`` (``(B, m, n)``), its largest singular value (power
    iteration on ``U^T U``; NaN stays NaN)."""
    v = torch.randn(U.shape[0], U.shape[2], 1, device=U.device, generator=gen)
    for _ in range(iters):
        v = U.mT @ (U @ v)
        v = v / v.norm(dim=1, keepdim=True)
    return (U @ v).norm(dim=1).squeeze(-1)


def measure(
    backend: str, steps: int, div: int, device: torch.device, momentum: float = 0.95
) -> list[dict]:
    """Rows ``{backend, shape, input, max_sigma, finite}`` of ``steps`` steps on ``backend``."""
    shapes = [(count, (m // div, n // div)) for count, (m, n) in SHAPES]
    params = [
        [torch.nn.Parameter(torch.zeros(shape, device=device)) for _ in range(count)]
        for count, shape in shapes
    ]
    opt = MuonForeach(
        [p for group in params for p in group],
        lr=1.0, momentum=momentum, wd=0.0, lr_adjust="none", backend=backend,
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    worst: dict[tuple, dict] = {}
    for step in range(steps):
        kind = INPUTS[step % len(INPUTS)]
        for group, (count, (m, n)) in zip(params, shapes, strict=True):
            for p, g in zip(group, stress_input(kind, count, m, n, gen), strict=True):
                p.grad = g
        before = [[p.detach().clone() for p in group] for group in params]
        opt.step()
        for group, old, (_, shape) in zip(params, before, shapes, strict=True):
            U = torch.stack([o - p.detach() for o, p in zip(old, group, strict=True)])
            finite = bool(torch.isfinite(U).all())
            sigma = float(largest_singular_value(U.float(), gen).max()) if finite else float("inf")
            row = worst.setdefault((shape, kind), {"max_sigma": 0.0, "finite": True})
            row["max_sigma"] = max(row["max_sigma"], sigma)
            row["finite"] &= finite
    return [
        {"backend": backend, "shape": f"{m}x{n}", "input": kind, **row}
        for ((m, n), kind), row in worst.items()
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=BACKENDS, help=f"comma-separated (default {BACKENDS})")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per backend")
    p.add_argument("--momentum", type=float, default=0.95, help="0: the direction is the gradient")
    p.add_argument("--div", type=int, default=1, help="divide every matrix dimension by this")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--limit", type=float, default=1.25, help="largest singular value allowed")
    p.add_argument("--json", type=Path, help="write the rows to this file")
    args = p.parse_args(argv)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    rows = []
    for backend in (b for b in args.backends.split(",") if b):
        rows += measure(backend, args.steps, args.div, device, args.momentum)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"update_spectrum: {name}, torch {torch.__version__}, {args.steps} steps per backend, "
          f"momentum {args.momentum}")  # fmt: skip
    print("| backend | shape | input | largest singular value | finite |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {r['shape']} | {r['input']} | {r['max_sigma']:.4f} | "
              f"{'yes' if r['finite'] else 'NO'} |")  # fmt: skip
    bad = [r for r in rows if not r["finite"] or r["max_sigma"] > args.limit]
    for r in bad:
        print(f"update_spectrum: {r['backend']} {r['shape']} {r['input']}: largest singular "
              f"value {r['max_sigma']:.4f} (limit {args.limit})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                         "steps": args.steps, "momentum": args.momentum,
                                         "rows": rows}, indent=1))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
