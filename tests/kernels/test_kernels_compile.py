"""Every Triton kernel of the package compiles for a Hopper GPU (sm_90) on this CPU machine.

Triton's interpreter runs a kernel's Python, so it passes code that the GPU compiler refuses;
this test runs Triton's whole compiler (down to a cubin, with its bundled ptxas) on each launch
the package's own launchers make, in a subprocess (tests/support/kernel_compile_hopper.py) that
stands in an sm_90 target for the missing CUDA driver and launches nothing."""

from __future__ import annotations

import pytest
from subprocess_env import run_test_script

from muon_plugin.kernels import triton_available


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_every_kernel_compiles_for_hopper():
    res = run_test_script("kernel_compile_hopper.py")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
