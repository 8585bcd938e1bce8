"""The grouped Triton elementwise kernels equal the foreach math (Triton interpreter, CPU).

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is imported),
with CPU tensors admitted to the kernel path. Its fp32 -> bf16 cast truncates where the GPU
rounds to nearest even; the check patches it to round like the GPU (and like torch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from muon_plugin.kernels import triton_available
from muon_plugin.kernels.elementwise import kernel_groups

CHECK = textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    _cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            bits = x.view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return _cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rne

    from muon_plugin import functional
    from muon_plugin.kernels import _elementwise_triton as k
    from muon_plugin.kernels import elementwise

    BLOCK = k.BLOCK
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    # ragged multi-tile, one element, an exact tile, empty, a small odd one
    SHAPES = [(3, BLOCK // 2 + 3), (1,), (BLOCK,), (0, 5), (5, 7)]
    launches = []
    _launch = k.grouped_momentum, k.grouped_decay_update

    def spy(fn):
        def wrapped(a, b, *args):
            launches.append((fn.__name__, len(a), a[0].dtype, b[0].dtype))
            return fn(a, b, *args)
        return wrapped

    k.grouped_momentum, k.grouped_decay_update = map(spy, _launch)

    def run(kernels, fn, *args):
        elementwise._ALLOW_CPU = kernels
        try:
            return fn(*args)
        finally:
            elementwise._ALLOW_CPU = False

    def close(actual, expected, *operands):
        # within one ulp of the largest operand (fma vs. separate rounding on the CPU reference)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        if not actual.numel():
            return
        scale = max(x.abs().max().item() for x in (expected, *operands))
        err = (actual.double() - expected.double()).abs().max().item()
        assert err <= torch.finfo(actual.dtype).eps * scale, (err, scale, actual.dtype)

    def misaligned(shape, dtype):  # contiguous, one element past an aligned start
        n = torch.Size(shape).numel()
        return torch.empty(n + 1, dtype=dtype)[1:].view(shape)

    def lists(dtypes, misalign=False):
        make = misaligned if misalign else torch.empty
        out = [], []
        for i, shape in enumerate(SHAPES * len(dtypes)):
            for lst, dt in zip(out, dtypes[i // len(SHAPES)]):
                lst.append(make(shape, dtype=dt).copy_(torch.randn(shape)))
        return out

    def clone(ts):
        return [t.clone() for t in ts]

    torch.manual_seed(0)
    # momentum: (grad, buffer) dtypes; a mixed list; misaligned pointers
    cases = [[(f32, f32)], [(bf16, f32), (f32, f32), (f16, f32)], [(bf16, bf16)], [(f32, bf16)]]
    for dtypes, misalign in [(c, False) for c in cases] + [([(f32, f32)], True)]:
        for mom, nesterov in [(0.9, True), (0.9, False), (0.3, True)]:
            grads, bufs = lists(dtypes, misalign)
            ref_bufs = clone(bufs)
            launches.clear()
            dirs = run(True, functional.momentum_update_, grads, bufs, mom, nesterov)
            assert len(launches) == len(dtypes), launches
            ref = run(False, functional.momentum_update_, grads, ref_bufs, mom, nesterov)
            for g, b, rb, d, rd in zip(grads, bufs, ref_bufs, dirs, ref):
                close(b, rb, g, rb)
                assert d.dtype == bf16 and d.shape == b.shape
                close(d, rd.to(bf16), g, rb)

    # decay + update: (param, update) dtypes, cautious or not, with and without decay
    cases = [[(f32, f32)], [(f32, bf16)], [(bf16, bf16), (f32, f32)], [(f16, f32)]]
    for dtypes, misalign in [(c, False) for c in cases] + [([(f32, bf16)], True)]:
        for cautious in (True, False):
            for lr, wd in [(0.1, 0.5), (0.02, 0.0)]:
                params, updates = lists(dtypes, misalign)
                for u in updates:  # u * p == 0: no decay when cautious
                    u.view(-1)[::7] = 0
                ref = clone(params)
                launches.clear()
                run(True, functional.decay_and_update_, params, updates, lr, wd, cautious)
                assert len(launches) == len(dtypes), launches
                run(False, functional.decay_and_update_, ref, updates, lr, wd, cautious)
                for p, r, u in zip(params, ref, updates):
                    close(p, r, r, u)
    # the cautious mask matters: with the same inputs plain decay differs
    params, updates = lists([(f32, f32)])
    plain = clone(params)
    run(True, functional.decay_and_update_, params, updates, 0.1, 0.5, True)
    run(True, functional.decay_and_update_, plain, updates, 0.1, 0.5, False)
    assert not all(torch.equal(a, b) for a, b in zip(params, plain))

    # empty lists launch nothing; a non-contiguous pair takes the foreach path
    launches.clear()
    assert run(True, functional.momentum_update_, [], [], 0.9, True) == []
    run(True, functional.decay_and_update_, [], [], 0.1, 0.5, True)
    assert not launches
    grads, bufs = lists([(f32, f32)])
    grads[0], bufs[0] = (x.t().contiguous().t() for x in (grads[0], bufs[0]))
    ref_bufs = clone(bufs)
    dirs = run(True, functional.momentum_update_, grads, bufs, 0.9, True)
    ref = run(False, functional.momentum_update_, grads, ref_bufs, 0.9, True)
    assert launches == [("grouped_momentum", len(SHAPES) - 1, f32, f32)], launches
    assert dirs[0].dtype == f32 and torch.equal(dirs[0], ref[0])
    for d, rd in zip(dirs[1:], ref[1:]):
        close(d, rd.to(bf16), rd)

    # tables: cached per list; new pointers (same shapes) get their own, never stale ones
    k.clear_caches()
    grads, bufs = lists([(f32, f32)])
    for _ in range(2):
        run(True, functional.momentum_update_, grads, bufs, 0.9, True)
    assert len(k._pointer_tables) == 1 and len(k._layouts) == 1
    grads2, bufs2 = clone(grads), clone(bufs)
    ref_bufs = clone(bufs)
    run(True, functional.momentum_update_, grads2, bufs2, 0.9, True)
    run(False, functional.momentum_update_, grads, ref_bufs, 0.9, True)
    assert len(k._pointer_tables) == 2 and len(k._layouts) == 1
    for b, b2, rb in zip(bufs, bufs2, ref_bufs):
        close(b2, rb, rb)
    print("OK")
    """
)


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_grouped_elementwise_kernels_match_foreach_math():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MUON_PLUGIN_DISABLE_TRITON", None)
    res = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_kernel_groups_leave_cpu_tensors_to_foreach(monkeypatch):
    a = [torch.zeros(3), torch.zeros(2)]
    assert kernel_groups(a, a) == ([], [0, 1])
    monkeypatch.setattr("muon_plugin.kernels.elementwise._ALLOW_CPU", True)
    monkeypatch.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")
    assert kernel_groups(a, a) == ([], [0, 1])


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
