"""MuonLP without torchao: int8 / fp8 fail with the install hint, bf16 / int4 step.

Run by ``tests/lp/test_lp.py`` in a subprocess (it hides torchao from that interpreter); prints
``OK``. Importing this module runs nothing.
"""

from __future__ import annotations

import sys


def main() -> None:
    sys.modules["torchao"] = None  # as if torchao were not installed
    import torch

    from muon_plugin import MuonForeach, MuonLP

    p = torch.nn.Parameter(torch.randn(64, 256))
    for dtype in ("int8", "fp8"):
        try:
            MuonLP([p], state_dtype=dtype)
        except ImportError as e:
            assert "pip install 'muon_plugin[lp]'" in str(e), str(e)
        else:
            raise AssertionError(f"{dtype}: no ImportError without torchao")
    for opt in (MuonLP([p], state_dtype=d) for d in ("bf16", "int4")):
        p.grad = torch.randn(64, 256)
        opt.step()
    for opt in (MuonForeach([p]),):
        p.grad = torch.randn(64, 256)
        opt.step()
    assert "torchao" not in [m for m, v in sys.modules.items() if v is not None]
    print("OK")


if __name__ == "__main__":
    main()
