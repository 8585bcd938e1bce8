"""CPU smoke test of scripts/polar_accuracy.py at tiny sizes: every variant, input and path
gives a distance, the GPU paths it emulates are the "auto" backend's for the full shapes, and
its fp64 AOL scaling is turbo_muon's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import polar_accuracy as pa  # noqa: E402


def test_tiny_run_reports_every_variant_input_and_path(tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert pa.main(["--div", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    variants = {f"{s} x{n}" for s, n in pa.VARIANTS}
    assert {r["variant"] for r in rows} == variants
    assert {r["input"] for r in rows} == set(pa.INPUTS)
    assert {r["path"].split(" (")[0] for r in rows} == {"native", "gpu"}
    assert len(rows) == len(pa.ORTHO_SHAPES) * len(pa.INPUTS) * 2 * len(variants)
    assert all(0 < r["err_polar"] < 1.2 and 0 < r["caveat"] < 1 for r in rows)
    assert all(("err_target" in r) == r["variant"].startswith("turbo") for r in rows)
    printed = capsys.readouterr().out
    assert "| native | gauss | turbo_muon x4 |" in printed
    assert "4x4: gpu (x, triton(ptr))" not in printed  # shapes are named as measured
    assert "64x64: gpu (x, triton(ptr))" in printed  # 4096 x 4096 on a GPU: the kernel


def test_the_other_published_sets_run_on_both_paths(capsys):
    argv = ["--div", "64", "--inputs", "gauss", "--variants", "turbo_set_i x4,turbo_set_iii x4"]
    assert pa.main(argv) == 0
    printed = capsys.readouterr().out
    for path in ("native", "gpu"):
        for variant in ("turbo_set_i x4", "turbo_set_iii x4"):
            assert f"| {path} | gauss | {variant} |" in printed


def test_aol_scaling_is_turbo_muons():
    """zeropower's turbo_muon approximates the polar factor of the script's fp64 ``D G``:
    with uneven rows, clearly closer to it than to the polar factor of ``G``."""
    G = torch.randn(24, 80, generator=torch.Generator().manual_seed(0)).double()
    G[3] *= 20.0  # uneven rows: D is far from a scalar
    target, exact = pa.exact_polar(pa.aol_scaled(G)), pa.exact_polar(G)
    out = pa.zeropower(G.float(), 4, "turbo_muon")
    to_target = pa.rel_err(out, target)
    assert to_target < 0.04 and pa.rel_err(out, exact) > to_target + 0.02
    assert pa.rel_err(exact, target) > 0.04
