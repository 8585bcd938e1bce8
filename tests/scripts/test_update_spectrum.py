"""scripts/update_spectrum.py on the CPU at small sizes: every backend, shape and input gives a
finite largest singular value near 1 through the optimizer's step, and a value over the limit
fails the run naming the backend, shape and input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import update_spectrum as us  # noqa: E402


@pytest.mark.parametrize("momentum", ["0.95", "0"])
def test_every_backend_keeps_the_update_orthogonal(tmp_path, capsys, momentum):
    out = tmp_path / "spectrum.json"
    argv = ["--div", "16", "--steps", str(len(us.INPUTS)), "--device", "cpu", "--json", str(out)]
    assert us.main([*argv, "--momentum", momentum]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(us.BACKENDS.split(",")) * len(us.SHAPES) * len(us.INPUTS)
    assert all(r["finite"] and 0.9 < r["max_sigma"] < 1.2 for r in rows), rows
    assert "| auto | 48x48 | spike |" in capsys.readouterr().out


def test_a_value_over_the_limit_fails_naming_it(capsys):
    argv = ["--div", "16", "--steps", "1", "--device", "cpu", "--backends", "plain"]
    assert us.main([*argv, "--limit", "0.5"]) == 1
    assert "update_spectrum: plain 48x48 gauss: largest singular value" in capsys.readouterr().out


def test_the_power_iteration_finds_the_largest_singular_value():
    gen = torch.Generator().manual_seed(1)
    U = torch.randn(3, 20, 30, generator=gen)
    exact = torch.linalg.svdvals(U)[:, 0]
    torch.testing.assert_close(
        us.largest_singular_value(U, gen, iters=200), exact, rtol=1e-3, atol=0
    )
    with pytest.raises(ValueError, match="unknown input"):
        us.stress_input("nope", 1, 4, 4, gen)
