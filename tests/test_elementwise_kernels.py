"""The fused Triton elementwise kernels equal the foreach math (Triton interpreter, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from muon_plugin.kernels import triton_available

CHECK = textwrap.dedent(
    """
    import torch
    from muon_plugin.functional import decay_and_update_, momentum_update_
    from muon_plugin.kernels import _elementwise_triton as k

    torch.manual_seed(0)
    n = 3 * k.BLOCK + 77  # several programs and a ragged tail
    for nesterov in (True, False):
        for gdtype in (torch.float32, torch.bfloat16):
            g = torch.randn(n).to(gdtype)
            buf = torch.randn(n)
            ref_buf = buf.clone()
            (ref_dir,) = momentum_update_([g], [ref_buf], 0.9, nesterov)
            direction = torch.empty(n, dtype=torch.bfloat16)
            k.momentum(g, buf, direction, 0.9, nesterov)
            torch.testing.assert_close(buf, ref_buf, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(direction, ref_dir.bfloat16(), rtol=8e-3, atol=1e-5)
    for cautious in (True, False):
        p = torch.randn(n)
        u = torch.randn(n).bfloat16()
        ref = p.clone()
        decay_and_update_([ref], [u], 0.1, 0.5, cautious)
        k.decay_update(p, u, 0.1, 0.1 * 0.5, cautious)
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
        if cautious:  # the mask really matters: plain decay differs
            plain = p.clone()
            k.decay_update(plain, u, 0.1, 0.05, False)
            assert not torch.allclose(plain, p)
    print("OK")
    """
)


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_fused_elementwise_kernels_match_foreach_math():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
