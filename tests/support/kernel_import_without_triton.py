"""``import muon_plugin.kernels`` without triton: torch products, a clear error for the kernel.

Run by ``tests/kernels/test_kernels.py`` in a subprocess (it hides triton from that interpreter);
prints ``ok``. Importing this module runs nothing.
"""

from __future__ import annotations

import sys


def main() -> None:
    sys.modules["triton"] = None  # makes `import triton` raise ImportError
    sys.modules["triton.language"] = None
    import torch

    import muon_plugin.kernels as k

    assert not k.triton_available()
    X = torch.randn(5, 7)
    assert torch.equal(k.gram(X), X @ X.mT)
    try:
        k.symmetric_matmul(X)
    except RuntimeError as e:
        assert "triton" in str(e)
    else:
        raise AssertionError("symmetric_matmul ran without triton")
    print("ok")


if __name__ == "__main__":
    main()
