"""``"turbo_muon"`` on the Triton kernel paths, with the real symmetric kernel interpreted.

Run by ``tests/orthogonalize/test_turbo_muon.py`` in a subprocess with ``TRITON_INTERPRET=1``:
``python tests/support/kernel_interpreter_turbo.py`` prints one JSON line per (path, shape): the
relative distance to the fp64 map and to the same path with the kernel's products emulated
(``kernel_like_gram``). Importing this module runs nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    # The orthogonalization tests this checks against live beside them.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "orthogonalize"))
    from interpreter_rounding import round_casts_to_nearest_even
    from test_orthogonalize import KERNEL, KERNEL_GRAM, gradient_like, kernel_like_gram, rel_err
    from test_turbo_muon import float64_turbo

    import muon_plugin.orthogonalize.iterations as iterations
    from muon_plugin.orthogonalize import zeropower

    round_casts_to_nearest_even()
    kernel_gram = iterations.gram
    for name, path in (("x-space", KERNEL), ("gram-space", KERNEL_GRAM)):
        for shape in ((40, 96), (96, 40), (2, 32, 72)):
            G = gradient_like(*shape, seed=5) * 1e3
            out = zeropower(G, 4, "turbo_muon", scale=1.3, path=path)
            iterations.gram = kernel_like_gram
            try:
                emulated = zeropower(G, 4, "turbo_muon", scale=1.3, path=path)
            finally:
                iterations.gram = kernel_gram
            row = {
                "path": name,
                "shape": list(shape),
                "err_fp64": rel_err(out, float64_turbo(G, 4, scale=1.3)),
                "err_emulated": rel_err(out, emulated),
            }
            print(json.dumps(row))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
