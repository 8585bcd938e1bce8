"""The grouped Triton elementwise kernels equal the foreach math (Triton interpreter, CPU).

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is imported), with
CPU tensors admitted to the kernel path: the module
tests/support/kernel_interpreter_elementwise.py. Its fp32 -> bf16 cast truncates where the GPU
rounds to nearest even; the check patches it to round like the GPU (and like torch).
"""

from __future__ import annotations

import pytest
import torch
from subprocess_env import run_in_interpreter

from muon_plugin.kernels import triton_available
from muon_plugin.kernels.elementwise import kernel_groups


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
@pytest.mark.interpreter
def test_grouped_elementwise_kernels_match_foreach_math():
    res = run_in_interpreter("kernel_interpreter_elementwise.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_kernel_groups_leave_cpu_tensors_to_foreach(monkeypatch):
    a = [torch.zeros(3), torch.zeros(2)]
    assert kernel_groups(a, a) == ([], [0, 1])
    monkeypatch.setattr("muon_plugin.kernels.elementwise._ALLOW_CPU", True)
    monkeypatch.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")
    assert kernel_groups(a, a) == ([], [0, 1])
    assert kernel_groups(a, a, enabled=False) == ([], [0, 1])  # the backend's call


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_kernel_groups_follow_the_backend(monkeypatch):
    """``enabled`` (what elementwise_kernels_allowed resolved from the backend's name, the
    environment's overrides included) is what counts; without it (a one-off call) the
    environment is read."""
    from muon_plugin.orthogonalize import elementwise_kernels_allowed

    monkeypatch.setattr("muon_plugin.kernels.elementwise._ALLOW_CPU", True)
    monkeypatch.delenv("MUON_PLUGIN_DISABLE_TRITON", raising=False)
    a = [torch.zeros(3), torch.zeros(2)]
    assert kernel_groups(a, a) == ([[0, 1]], [])  # the default: the kernels, as before
    for name, expected in [("auto", ([[0, 1]], [])), ("cublas", ([], [0, 1]))]:
        assert kernel_groups(a, a, enabled=elementwise_kernels_allowed(name)) == expected
    assert kernel_groups(a, a, enabled=elementwise_kernels_allowed("plain")) == ([], [0, 1])
    assert not elementwise_kernels_allowed("auto:no-triton")
    monkeypatch.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")  # read by one-off calls only
    assert kernel_groups(a, a) == ([], [0, 1])
    assert kernel_groups(a, a, enabled=True) == ([[0, 1]], [])


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_kernel_groups_split_by_dtype_and_layout(monkeypatch):
    monkeypatch.setattr("muon_plugin.kernels.elementwise._ALLOW_CPU", True)
    monkeypatch.delenv("MUON_PLUGIN_DISABLE_TRITON", raising=False)
    bf16 = torch.bfloat16
    ps = [torch.zeros(4), torch.zeros(4, dtype=bf16), torch.zeros(2, 3).t(), torch.zeros(2)]
    ps.append(torch.zeros(3, dtype=torch.float64))
    us = [torch.zeros(4, dtype=bf16), torch.zeros(4, dtype=bf16), torch.zeros(3, 2)]
    us += [torch.zeros(2, dtype=bf16), torch.zeros(3, dtype=torch.float64)]
    assert kernel_groups(ps, us) == ([[0, 3], [1]], [2, 4])


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_a_lone_small_tensor_stays_on_foreach(monkeypatch):
    """The per-parameter driver passes one tensor at a time: small ones keep the foreach path."""
    monkeypatch.setattr("muon_plugin.kernels.elementwise._ALLOW_CPU", True)
    monkeypatch.delenv("MUON_PLUGIN_DISABLE_TRITON", raising=False)
    small = [torch.zeros(768, 768)]
    assert kernel_groups(small, small) == ([], [0])
    big = [torch.zeros(1 << 22)]
    assert kernel_groups(big, big) == ([[0]], [])
    assert kernel_groups(small * 2, small * 2) == ([[0, 1]], [])
