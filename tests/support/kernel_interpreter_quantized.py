"""The fused int8 momentum kernel against torchao's ops, in the Triton interpreter.

Run by ``tests/kernels/test_quantized_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (it
must be set before triton is imported); prints ``OK``. Several steps of Int8Codec's update, once
through the kernel and once through torchao's eager ops, on the same gradients: the scales, codes
and directions agree (codes may differ by one level only where ``buf / scale`` lies on a rounding
boundary to within an ulp, since the CPU reference rounds the lerp without fused multiply-adds); and
one launch over momenta of several shapes (the step's grouped update) equals each momentum's own
launch. Importing this module runs nothing.
"""

from __future__ import annotations

import torch
from interpreter_rounding import round_casts_to_nearest_even

from muon_plugin.kernels.quantized import int8_kernel_applies
from muon_plugin.lp import Int8Codec
from muon_plugin.lp.keys import CODES_KEY, SCALES_KEY


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual.double() - expected.double()).abs().max() / scale
    assert err <= 4 * torch.finfo(torch.float32).eps, (what, err.item())


def steps(codec: Int8Codec, shape, grad_dtype, nesterov: bool, stacked: bool) -> None:
    torch.manual_seed(hash((shape, str(grad_dtype), nesterov)) % 2**31)
    fused, eager = codec.zeros(torch.empty(shape)), codec.zeros(torch.empty(shape))
    for step in range(4):
        grad = (torch.randn(shape) * torch.rand(shape[-2], 1) * 10**-step).to(grad_dtype)
        assert int8_kernel_applies(fused[CODES_KEY], fused[SCALES_KEY], grad, True)
        kw = dict(stacked=stacked)
        d_fused = codec.update_(fused, grad, 0.95, nesterov, kernels=True, **kw)
        d_eager = codec.update_(eager, grad, 0.95, nesterov, kernels=False, **kw)
        where = f"{shape} {grad_dtype} nesterov={nesterov} step {step}"
        close(fused[SCALES_KEY], eager[SCALES_KEY], f"scales, {where}")
        close(d_fused, d_eager, f"direction, {where}")
        diff = (fused[CODES_KEY].int() - eager[CODES_KEY].int()).abs()
        assert diff.max() <= 1 and diff.sum() <= max(2, diff.numel() // 10_000), where
        fused[CODES_KEY].copy_(eager[CODES_KEY])  # the next step starts from equal states
        fused[SCALES_KEY].copy_(eager[SCALES_KEY])


def grouped(codec, shapes, grad_dtype, nesterov: bool, gradient=None) -> None:
    """One launch over momenta of several shapes equals each momentum's own launch bit for
    bit (states), with the direction rounded once to bf16. ``gradient(shape, step)``: the
    step's gradient (default: Gaussian, smaller every step)."""
    torch.manual_seed(len(shapes) + codec.block_size)
    together = [codec.zeros(torch.empty(s)) for s in shapes]
    alone = [codec.zeros(torch.empty(s)) for s in shapes]
    for step in range(3):
        grads = [
            (gradient(s, step) if gradient else torch.randn(s) * 3.0**-step).to(grad_dtype)
            for s in shapes
        ]
        assert all(codec.fused_applies(st, g, True) for st, g in zip(together, grads, strict=True))
        d_together = codec.fused_update_(together, grads, 0.9, nesterov)
        for i, (state, grad) in enumerate(zip(alone, grads, strict=True)):
            d_alone = codec.update_(state, grad, 0.9, nesterov, kernels=True)
            where = f"grouped {shapes[i]} {grad_dtype} nesterov={nesterov} step {step}"
            assert d_together[i].dtype == torch.bfloat16 and d_together[i].shape == grad.shape
            assert torch.equal(d_together[i], d_alone.to(torch.bfloat16)), where
            for key in codec.keys:
                assert torch.equal(together[i][key], state[key]), (key, where)


def main() -> None:
    round_casts_to_nearest_even()  # bf16 directions round as on the GPU
    for grad_dtype in (torch.float32, torch.bfloat16):
        for nesterov in (True, False):
            # shapes of one launch: a tile cut mid-tensor, a 3-D stack, one short tile
            shapes = [(24, 512), (2, 3, 768), (5, 256), (24, 512)]
            grouped(Int8Codec(256), shapes, grad_dtype, nesterov)
        grouped(Int8Codec(4096), [(3, 4096), (1, 8192)], grad_dtype, True)

    for block, shape, stacked in [
        (256, (64, 512), False),
        (64, (3, 40, 192), True),  # a stack: leading dim of same-shape parameters
        (4096, (4, 4096), False),  # one block per program
    ]:
        for grad_dtype in (torch.float32, torch.bfloat16):
            for nesterov in (True, False):
                steps(Int8Codec(block), shape, grad_dtype, nesterov, stacked)
    codec = Int8Codec(256)
    state = codec.zeros(torch.empty(8, 512))
    ragged = torch.zeros(8, 512)[:, :256]  # not contiguous: the torchao ops take it
    assert not int8_kernel_applies(state[CODES_KEY], state[SCALES_KEY], ragged, True)
    assert not int8_kernel_applies(state[CODES_KEY], state[SCALES_KEY], torch.zeros(8, 512), False)
    odd = Int8Codec(96).zeros(torch.empty(4, 192))  # block 96: not a power of two
    assert not int8_kernel_applies(odd[CODES_KEY], odd[SCALES_KEY], torch.zeros(4, 192), True)
    print("OK")


if __name__ == "__main__":
    main()
