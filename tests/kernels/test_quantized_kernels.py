"""The fused int8 momentum kernel (muon_plugin.kernels.quantized) equals torchao's ops.

The Triton interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is
imported): the module tests/support/kernel_interpreter_quantized.py. The GPU comparison is in
tests/lp/test_lp_int8.py (CUDA only)."""

from __future__ import annotations

import pytest
import torch
from subprocess_env import run_in_interpreter

from muon_plugin.kernels import triton_available
from muon_plugin.kernels.quantized import int8_kernel_applies


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_int8_momentum_kernel_matches_torchao_ops():
    pytest.importorskip("torchao")
    res = run_in_interpreter("kernel_interpreter_quantized.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_cpu_tensors_take_the_torchao_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    codes, scales = torch.zeros(8, 512, dtype=torch.uint8), torch.zeros(8, 2)
    assert not int8_kernel_applies(codes, scales, torch.zeros(8, 512), True)
