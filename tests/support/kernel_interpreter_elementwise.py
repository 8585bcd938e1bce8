"""The grouped elementwise Triton kernels against the foreach math, in the Triton interpreter.

Run by ``tests/kernels/test_elementwise_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (it
must be set before triton is imported), with CPU tensors admitted to the kernel path; prints
``OK``. The interpreter's fp32 -> bf16 cast is patched to round like the GPU
(``interpreter_rounding``). Importing this module runs nothing.
"""

from __future__ import annotations

import torch
from interpreter_rounding import round_casts_to_nearest_even

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
launches: list[tuple] = []


def spy_on_launches(k) -> None:
    def spy(fn):
        def wrapped(a, b, *args):
            launches.append((fn.__name__, len(a), a[0].dtype, b[0].dtype))
            return fn(a, b, *args)

        return wrapped

    k.grouped_momentum, k.grouped_decay_update = map(
        spy, (k.grouped_momentum, k.grouped_decay_update)
    )


def run(kernels: bool, fn, *args):
    from muon_plugin.kernels import elementwise

    elementwise._ALLOW_CPU = kernels
    try:
        return fn(*args)
    finally:
        elementwise._ALLOW_CPU = False


def close(actual, expected, *operands) -> None:
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


def clone(ts):
    return [t.clone() for t in ts]


class Cases:
    def __init__(self, block: int) -> None:
        # ragged multi-tile, one element, an exact tile, empty, a small odd one
        self.shapes = [(3, block // 2 + 3), (1,), (block,), (0, 5), (5, 7)]
        self.block = block

    def with_long_rows(self) -> Cases:
        """These shapes and rows longer than a tile (a tile inside one row, or across two)."""
        longer = Cases(self.block)
        longer.shapes = [*self.shapes, (3, self.block + 5)]
        return longer

    def lists(self, dtypes, misalign=False):
        make = misaligned if misalign else torch.empty
        out = [], []
        for i, shape in enumerate(self.shapes * len(dtypes)):
            for lst, dt in zip(out, dtypes[i // len(self.shapes)], strict=True):
                lst.append(make(shape, dtype=dt).copy_(torch.randn(shape)))
        return out


def momentum(cases: Cases, functional) -> None:
    """(grad, buffer) dtypes; a mixed list; misaligned pointers."""
    lists = [[(f32, f32)], [(bf16, f32), (f32, f32), (f16, f32)], [(bf16, bf16)], [(f32, bf16)]]
    for dtypes, misalign in [(c, False) for c in lists] + [([(f32, f32)], True)]:
        for mom, nesterov in [(0.9, True), (0.9, False), (0.3, True)]:
            grads, bufs = cases.lists(dtypes, misalign)
            ref_bufs = clone(bufs)
            launches.clear()
            dirs = run(True, functional.momentum_update_, grads, bufs, mom, nesterov)
            assert len(launches) == len(dtypes), launches
            ref = run(False, functional.momentum_update_, grads, ref_bufs, mom, nesterov)
            for g, b, rb, d, rd in zip(grads, bufs, ref_bufs, dirs, ref, strict=True):
                close(b, rb, g, rb)
                assert d.dtype == bf16 and d.shape == b.shape
                close(d, rd.to(bf16), g, rb)


def decay_update(cases: Cases, functional) -> None:
    """(param, update) dtypes, cautious or not, with and without decay."""
    lists = [[(f32, f32)], [(f32, bf16)], [(bf16, bf16), (f32, f32)], [(f16, f32)]]
    for dtypes, misalign in [(c, False) for c in lists] + [([(f32, bf16)], True)]:
        for cautious in (True, False):
            for lr, wd in [(0.1, 0.5), (0.02, 0.0)]:
                params, updates = cases.lists(dtypes, misalign)
                for u in updates:  # u * p == 0: no decay when cautious
                    u.view(-1)[::7] = 0
                ref = clone(params)
                launches.clear()
                run(True, functional.decay_and_update_, params, updates, lr, wd, cautious)
                assert len(launches) == len(dtypes), launches
                run(False, functional.decay_and_update_, ref, updates, lr, wd, cautious)
                for p, r, u in zip(params, ref, updates, strict=True):
                    close(p, r, r, u)
    # the cautious mask matters: with the same inputs plain decay differs
    params, updates = cases.lists([(f32, f32)])
    plain = clone(params)
    run(True, functional.decay_and_update_, params, updates, 0.1, 0.5, True)
    run(True, functional.decay_and_update_, plain, updates, 0.1, 0.5, False)
    assert not all(torch.equal(a, b) for a, b in zip(params, plain, strict=True))


def decay_update_row_factors(cases: Cases, functional) -> None:
    """NorMuon: the update times one fp32 factor per row (zero factors included); rows of any
    length (a factor per element), and rows all a multiple of 8 long (a factor per run of 8)."""
    b = cases.block
    runs = Cases(b)
    runs.shapes = [(3, b // 2 + 8), (b // 8 + 3, 8), (2, b + 16), (0, 8), (1, 8), (5, 24)]
    long_rows = cases.with_long_rows()
    for dtypes, shapes in [
        ([(f32, bf16)], long_rows),
        ([(bf16, bf16)], long_rows),
        ([(f32, f32)], long_rows),
        ([(f32, bf16)], runs),
        ([(bf16, bf16)], runs),
    ]:
        for cautious in (True, False):
            params, updates = shapes.lists(dtypes)
            factors = [torch.rand(u.shape[:-1]) + 0.5 for u in updates]
            for f in factors:
                f.view(-1)[::3] = 0.0
            ref = clone(params)
            launches.clear()
            args = (0.1, 0.5, cautious, None, factors)
            run(True, functional.decay_and_update_, params, updates, *args)
            assert len(launches) == 1, launches
            run(False, functional.decay_and_update_, ref, updates, *args)
            for p, r, u, f in zip(params, ref, updates, factors, strict=True):
                close(p, r, r, u.float() * f.view(*f.shape, *([1] * (u.dim() - f.dim()))))
    # the factors matter: without them the same inputs give another step
    params, updates = cases.lists([(f32, bf16)])
    plain = clone(params)
    factors = [torch.rand(u.shape[:-1]) + 0.5 for u in updates]
    run(True, functional.decay_and_update_, params, updates, 0.1, 0.5, True, None, factors)
    run(True, functional.decay_and_update_, plain, updates, 0.1, 0.5, True)
    assert not all(torch.equal(a, b) for a, b in zip(params, plain, strict=True))


def edges(cases: Cases, functional) -> None:
    """Empty lists launch nothing; a non-contiguous pair takes the foreach path."""
    launches.clear()
    assert run(True, functional.momentum_update_, [], [], 0.9, True) == []
    run(True, functional.decay_and_update_, [], [], 0.1, 0.5, True)
    assert not launches
    grads, bufs = cases.lists([(f32, f32)])
    grads[0], bufs[0] = (x.t().contiguous().t() for x in (grads[0], bufs[0]))
    ref_bufs = clone(bufs)
    dirs = run(True, functional.momentum_update_, grads, bufs, 0.9, True)
    ref = run(False, functional.momentum_update_, grads, ref_bufs, 0.9, True)
    assert launches == [("grouped_momentum", len(cases.shapes) - 1, f32, f32)], launches
    assert dirs[0].dtype == f32 and torch.equal(dirs[0], ref[0])
    for d, rd in zip(dirs[1:], ref[1:], strict=True):
        close(d, rd.to(bf16), rd)


def tables(cases: Cases, functional, k) -> None:
    """Cached per list; new pointers (same shapes) get their own, never stale ones."""
    k.clear_caches()
    grads, bufs = cases.lists([(f32, f32)])
    for _ in range(2):
        run(True, functional.momentum_update_, grads, bufs, 0.9, True)
    assert len(k._pointer_tables) == 1 and len(k._layouts) == 1
    grads2, bufs2 = clone(grads), clone(bufs)
    ref_bufs = clone(bufs)
    run(True, functional.momentum_update_, grads2, bufs2, 0.9, True)
    run(False, functional.momentum_update_, grads, ref_bufs, 0.9, True)
    assert len(k._pointer_tables) == 2 and len(k._layouts) == 1
    for b2, rb in zip(bufs2, ref_bufs, strict=True):
        close(b2, rb, rb)


def main() -> None:
    round_casts_to_nearest_even()
    from muon_plugin import functional
    from muon_plugin.kernels import _elementwise_triton as k

    spy_on_launches(k)
    cases = Cases(k.BLOCK)
    torch.manual_seed(0)
    momentum(cases, functional)
    decay_update(cases, functional)
    decay_update_row_factors(cases, functional)
    edges(cases, functional)
    tables(cases, functional, k)
    print("OK")


if __name__ == "__main__":
    main()
