#!/usr/bin/env python
"""Distance to the exact polar factor on the benchmark's accuracy probe, per variant, input, path.

The probe is the ``ortho`` section's of ``scripts/benchmark.py``: its shapes (the Llama-3-8B
ones, matrix dims divided by ``--div``), its Gaussian and low-rank-plus-noise inputs (the same
generator, so ``--div 1`` on a GPU draws the benchmark's matrices), and its exact polar factor
(fp64). Two more gradient-like inputs: full rank with singular values decaying from 1 to 1e-2
(``decay2``) or 1e-3 (``decay3``), random singular vectors. Per variant (``polar_express x5``,
``polar_express x4``, ``turbo_muon x4``, ``turbo_muon x5``, ``newton_schulz x5``; on request
the two other published Turbo-Muon quintic sets with AOL, ``turbo_set_i x4`` and
``turbo_set_iii x4``) it reports the
relative Frobenius distance ``||O - polar(G)|| / ||polar(G)||``, the mean over the shapes and each
shape's; for turbo_muon also the distance to ``polar(D G)``, the factor it approximates (``D``:
AOL's row scaling of the wide orientation), and once per input how far that target is from
``polar(G)`` (the caveat of a non-scalar rescale).

Paths (``--paths``): ``native`` is ``zeropower``'s own path on ``--device`` (on the CPU the
plain bf16 loop; on a GPU the ``"auto"`` backend's per shape). ``gpu`` (CPU only) runs, for each
shape, the path the ``"auto"`` backend resolves for that shape at its full size on a CUDA GPU
(x-space or Gram space; Triton kernel or fp16 cuBLAS products; no CUDA graph, as the
benchmark's ``zeropower`` calls), with the kernel's products emulated (fp32 accumulation and
epilogue, one rounding).

    python scripts/polar_accuracy.py [--div 4] [--device cpu|cuda] [--paths native,gpu]
        [--inputs gauss,low_rank,decay2,decay3] [--variants "turbo_muon x4,..."] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the bench package

from bench.accuracy import exact_polar, low_rank_plus_noise  # noqa: E402
from bench.config import scale_shape  # noqa: E402
from bench.ortho import ORTHO_SHAPES  # noqa: E402

import muon_plugin.orthogonalize.iterations as iterations  # noqa: E402
from muon_plugin.orthogonalize import IterationPath, Schedule, run_iteration, zeropower  # noqa: E402
from muon_plugin.orthogonalize.api import iteration_backend  # noqa: E402
from muon_plugin.orthogonalize.paths import Features, iteration_path  # noqa: E402

VARIANTS = (
    ("polar_express", 5),
    ("polar_express", 4),
    ("turbo_muon", 4),
    ("turbo_muon", 5),
    ("newton_schulz", 5),
)
# The other published Turbo-Muon quintic sets, AOL-scaled like turbo_muon (comparison only):
# the 4-step tail of the earlier "quintic" schedule its first code used, and its first fitted set.
ALTERNATIVE_SETS = {
    "turbo_set_i": (
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "turbo_set_iii": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
}
OPTIONAL_VARIANTS = (("turbo_set_i", 4), ("turbo_set_iii", 4))
INPUTS = ("gauss", "low_rank", "decay2", "decay3")
PATHS = ("native", "gpu")


def decaying_spectrum(shape: tuple[int, ...], decades: float, gen: torch.Generator, device):
    """Full rank, singular values ``logspace(0, -decades)``, random singular vectors."""
    *batch, m, n = shape
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, k, generator=gen, device=device))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, k, generator=gen, device=device))
    s = torch.logspace(0, -decades, k, device=device)
    return (U * s.unsqueeze(-2)) @ V.mT


def aol_scaled(G: torch.Tensor) -> torch.Tensor:
    """``D G`` in fp64: the rows of the wide orientation divided by the square roots of the
    absolute row sums of its Gram matrix (what turbo_muon orthogonalizes)."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = X / (X @ X.mT).abs().sum(-1, keepdim=True).sqrt()
    return X.mT if tall else X


def orthogonalized(G: torch.Tensor, strategy: str, steps: int, path: IterationPath | None):
    """``zeropower`` of a strategy, or an alternative AOL set on the same path."""
    if strategy not in ALTERNATIVE_SETS:
        return zeropower(G, steps, strategy, path=path)
    if path is None:
        m, n = sorted(G.shape[-2:])
        path = iteration_backend("auto").iteration_path(math.prod(G.shape[:-2]), m, n, G.device)
    return run_iteration(G, Schedule(ALTERNATIVE_SETS[strategy][:steps], 1.0, True), path)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def emulated_kernel_gram(
    X, *, Y=None, alpha=1.0, C=None, beta=0.0, gamma=0.0, out_dtype=None, kernel=None, tma=None
):
    """The symmetric kernel's product on any device: fp32 accumulation and epilogue, then one
    rounding (where the path says ``kernel``; torch's product otherwise)."""
    if not kernel:
        return GRAM(X, Y=Y, alpha=alpha, C=C, beta=beta, gamma=gamma, out_dtype=out_dtype)
    X32 = X.float()
    Y32 = X32 if Y is None else Y.float()
    out = alpha * (X32 @ Y32.mT)
    if gamma:
        out = out + gamma * torch.eye(X.shape[-2], device=X.device)
    if C is not None:
        out = out + beta * C.float()
    return out.to(out_dtype or X.dtype)


GRAM = iterations.gram


@contextlib.contextmanager
def kernel_emulated() -> Iterator[None]:
    iterations.gram = emulated_kernel_gram
    try:
        yield
    finally:
        iterations.gram = GRAM


def gpu_path(full_shape: tuple[int, ...]) -> IterationPath:
    """The ``"auto"`` backend's path for ``full_shape`` on a CUDA GPU (no graph, no TMA)."""
    m, n = sorted(full_shape[-2:])
    batch = math.prod(full_shape[:-2])
    return iteration_path(batch, m, n, torch.device("cuda"), Features(tma=False))


def inputs_of(shape, names, gen, extra_gen, device) -> dict[str, torch.Tensor]:
    """The probe's inputs for one shape; ``gen`` draws the benchmark's two, in its order."""
    G = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    L = low_rank_plus_noise(shape, gen, device)
    out = {"gauss": G, "low_rank": L}
    for decades in (2, 3):
        out[f"decay{decades}"] = decaying_spectrum(shape, decades, extra_gen, device)
    return {k: out[k] for k in names}


def measure(args) -> list[dict]:
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(1)  # the benchmark's ortho generator
    extra_gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    for full in ORTHO_SHAPES:
        shape = scale_shape(full, args.div)
        for kind, G in inputs_of(shape, args.inputs, gen, extra_gen, device).items():
            exact = exact_polar(G)
            target = exact_polar(aol_scaled(G))
            caveat = rel_err(target, exact)
            for path_name in args.paths:
                path = None if path_name == "native" else gpu_path(full)
                products_in_kernel = path is not None and (path.xx_triton or path.mm_triton)
                ctx = kernel_emulated() if products_in_kernel else None
                with ctx or contextlib.nullcontext():
                    for strategy, steps in args.variants:
                        out = orthogonalized(G, steps=steps, strategy=strategy, path=path)
                        row = {
                            "shape": "x".join(map(str, shape)),
                            "input": kind,
                            "path": path_name if path is None else f"gpu ({path.describe()})",
                            "variant": f"{strategy} x{steps}",
                            "err_polar": rel_err(out, exact),
                            "caveat": caveat,
                        }
                        if strategy.startswith("turbo"):
                            row["err_target"] = rel_err(out, target)
                        rows.append(row)
            print(f"  {'x'.join(map(str, shape))} {kind}: done", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: per path, input and variant the mean over the shapes and each shape's."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    lines = [
        "| path | input | variant | mean err vs polar(G) | "
        + " | ".join(shapes)
        + " | mean err vs polar(D G) | mean distance polar(D G) to polar(G) |",
        "|" + " --- |" * (6 + len(shapes)),
    ]
    paths = list(dict.fromkeys(r["path"].split(" (")[0] for r in rows))
    for path in paths:
        for kind in dict.fromkeys(r["input"] for r in rows):
            for variant in dict.fromkeys(r["variant"] for r in rows):
                sel = [r for r in rows if r["path"].split(" (")[0] == path
                       and r["input"] == kind and r["variant"] == variant]  # fmt: skip
                if not sel:
                    continue
                per = {r["shape"]: f"{r['err_polar']:.4f}" for r in sel}
                target = [r["err_target"] for r in sel if "err_target" in r]
                cells = [
                    path,
                    kind,
                    variant,
                    f"{statistics.fmean(r['err_polar'] for r in sel):.4f}",
                    *(per.get(s, "-") for s in shapes),
                    f"{statistics.fmean(target):.4f}" if target else "-",
                    f"{statistics.fmean(r['caveat'] for r in sel):.4f}",
                ]
                lines.append("| " + " | ".join(cells) + " |")
    gpu = dict.fromkeys(f"{r['shape']}: {r['path']}" for r in rows if r["path"].startswith("gpu"))
    if gpu:
        lines += ["", "GPU paths emulated per shape: " + "; ".join(gpu)]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--div", type=int, default=4, help="divide the matrix dims by this")
    p.add_argument("--device", default="cpu")
    p.add_argument("--paths", default=None, help="native,gpu (default: gpu only on the CPU)")
    p.add_argument("--inputs", default=",".join(INPUTS))
    p.add_argument("--variants", default=",".join(f"{s} x{n}" for s, n in VARIANTS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.inputs = [i for i in args.inputs.split(",") if i]
    if not set(args.inputs) <= set(INPUTS):
        p.error(f"--inputs: choose from {INPUTS}")
    known = {f"{s} x{n}": (s, n) for s, n in (*VARIANTS, *OPTIONAL_VARIANTS)}
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not names or not set(names) <= set(known):
        p.error(f"--variants: choose from {', '.join(known)}")
    args.variants = [known[v] for v in names]
    cpu = torch.device(args.device).type == "cpu"
    default = "native,gpu" if cpu else "native"
    args.paths = [x for x in (args.paths or default).split(",") if x]
    if not set(args.paths) <= set(PATHS) or ("gpu" in args.paths and not cpu):
        p.error(f"--paths: choose from {PATHS} ('gpu' emulates a GPU's paths on the CPU)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    print(f"polar_accuracy: device {args.device}, matrix dims / {args.div}, torch "
          f"{torch.__version__}", flush=True)  # fmt: skip
    rows = measure(args)
    print(table(rows))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps({"div": args.div, "device": args.device, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
