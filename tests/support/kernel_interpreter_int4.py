"""The fused int4 momentum kernel against the torch ops of ``int4_update``, in the Triton
interpreter.

Run by ``tests/kernels/test_quantized_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (it
must be set before triton is imported); prints ``OK``. Several steps of Int4Codec's update, once
through the kernel and once through the torch ops, on the same gradients (rows of very different
sizes and all-zero rows, so every scale code from 0 to 255 can occur): bases, scale codes,
codes and directions agree, except where the CPU reference's lerp (rounded without fused
multiply-adds) puts a value an ulp across a cell edge: such an element takes the neighbouring
code, and a block whose absmax moves across a scale-code boundary the neighbouring scale code.
One launch over momenta of several shapes equals each momentum's own launch bit for bit
(``kernel_interpreter_quantized.grouped``), and MuonLP's step launches it once for all of its int4
momenta, whose states follow the torch ops'.
Importing this module runs nothing.
"""

from __future__ import annotations

import torch
from interpreter_rounding import round_casts_to_nearest_even
from kernel_interpreter_quantized import grouped

from muon_plugin.kernels.quantized import int4_kernel_applies
from muon_plugin.lp import Int4Codec
from muon_plugin.lp.int4 import unpack_int4
from muon_plugin.lp.keys import BASES_KEY, CODES_KEY, SCALE_CODES_KEY


def gradient(shape, step: int) -> torch.Tensor:
    """Rows from 1e-6 to 1e2, one all-zero row, smaller every step (fp32)."""
    rows = shape[-2] if len(shape) > 1 else 1
    size = 10.0 ** torch.linspace(-6, 2, rows).view(rows, 1)
    g = torch.randn(shape) * size * 10.0**-step
    g.view(-1, shape[-1])[0] = 0.0
    return g


def mismatches(a: torch.Tensor, b: torch.Tensor, what: str, where: str) -> int:
    diff = (a.int() - b.int()).abs()
    assert diff.max() <= 1, (what, where, diff.max().item())
    return int((diff > 0).sum())


def steps(codec: Int4Codec, shape, grad_dtype, nesterov: bool, stacked: bool) -> None:
    torch.manual_seed(hash((shape, str(grad_dtype), nesterov)) % 2**31)
    fused, eager = codec.zeros(torch.empty(shape)), codec.zeros(torch.empty(shape))
    for step in range(4):
        grad = gradient(shape, step).to(grad_dtype)
        assert codec.fused_applies(fused, grad, True)
        d_fused = codec.update_(fused, grad, 0.95, nesterov, kernels=True, stacked=stacked)
        d_eager = codec.update_(eager, grad, 0.95, nesterov, kernels=False, stacked=stacked)
        where = f"{shape} block {codec.block_size} {grad_dtype} nesterov={nesterov} step {step}"
        assert d_fused.dtype == torch.float32 and d_fused.shape == grad.shape, where
        scale = d_eager.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        err = ((d_fused - d_eager).abs() / scale).max().item()
        assert err <= 4 * torch.finfo(torch.float32).eps, ("direction", where, err)
        assert torch.equal(fused[BASES_KEY], eager[BASES_KEY]), where
        bad_scales = mismatches(fused[SCALE_CODES_KEY], eager[SCALE_CODES_KEY], "scales", where)
        codes = [unpack_int4(s[CODES_KEY].reshape(-1)) for s in (fused, eager)]
        bad_codes = mismatches(*codes, "codes", where)
        assert bad_scales <= 1 and bad_codes <= max(2, codes[0].numel() // 5_000), (
            where, bad_scales, bad_codes,
        )  # fmt: skip
        if step == 3:  # the sizes above reach both ends of the scale codes
            k = eager[SCALE_CODES_KEY]
            assert (k == 255).any() and (k == 0).any() and (k > 200).any(), where
        for key in codec.keys:  # the next step starts from equal states
            fused[key].copy_(eager[key])


def through_the_optimizer() -> None:
    """MuonLP's step takes the kernel for all of its int4 momenta at once (one launch a step),
    and its momentum states follow the torch ops' (the kernel refused, the rest of the step
    alike): a momentum depends on the gradients only, so after three steps the states agree as
    in ``steps`` (bases equal, codes within one level). The parameters are not compared: a
    direction an ulp apart (the CPU reference's lerp without fused multiply-adds) rounds to
    another bf16 value now and then, which the bf16 orthogonalization turns into differences of
    its own rounding noise."""
    from muon_plugin import MuonLP
    from muon_plugin.lp import int4 as int4_module

    launch, applies = int4_module.grouped_int4_momentum_, int4_module.int4_kernel_applies
    launches: list[int] = []

    def counted(codes, *args):
        launches.append(len(codes))
        return launch(codes, *args)

    shapes = [(64, 256), (32, 512), (64, 256)]
    runs = []
    for kernel in (True, False):
        int4_module.grouped_int4_momentum_ = counted
        int4_module.int4_kernel_applies = applies if kernel else (lambda *args: False)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = MuonLP([{"params": params}], lr=0.02, state_dtype="int4")
        for step in range(3):
            torch.manual_seed(step)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        runs.append((params, opt))
    int4_module.grouped_int4_momentum_, int4_module.int4_kernel_applies = launch, applies
    assert launches == [3, 3, 3], launches  # the kernel's run only, one launch a step
    (fused, fused_opt), (eager, eager_opt) = runs
    for a, b in zip(fused, eager, strict=True):
        where = f"through the optimizer, {tuple(a.shape)}"
        assert torch.isfinite(a).all(), where
        state, ref = fused_opt.state[a], eager_opt.state[b]
        assert torch.equal(state[BASES_KEY], ref[BASES_KEY]), where
        assert mismatches(state[SCALE_CODES_KEY], ref[SCALE_CODES_KEY], "scales", where) <= 1
        codes = [unpack_int4(t[CODES_KEY].reshape(-1)) for t in (state, ref)]
        assert mismatches(*codes, "codes", where) <= max(2, codes[0].numel() // 5_000), where


def refused() -> None:
    """What the kernel does not take goes to the torch ops."""
    codec = Int4Codec(16)
    state = codec.zeros(torch.empty(8, 512))
    keys = [state[k] for k in codec.keys]
    assert int4_kernel_applies(*keys, torch.zeros(8, 512), True)
    assert not int4_kernel_applies(*keys, torch.zeros(8, 512), False)  # kernels off
    assert not int4_kernel_applies(*keys, torch.zeros(8, 1024)[:, :512], True)  # not contiguous
    assert not int4_kernel_applies(*keys, torch.zeros(8, 512, dtype=torch.float64), True)
    assert not int4_kernel_applies(*keys, torch.zeros(8, 256), True)  # another size
    odd = Int4Codec(6).zeros(torch.empty(4, 192))  # block 6: not a power of two
    assert not int4_kernel_applies(*(odd[k] for k in codec.keys), torch.zeros(4, 192), True)
    big = Int4Codec(512).zeros(torch.empty(1, 8192))  # a super-block beyond one program's tile
    assert not int4_kernel_applies(*(big[k] for k in codec.keys), torch.zeros(1, 8192), True)


def main() -> None:
    round_casts_to_nearest_even()  # bf16 directions round as on the GPU
    for grad_dtype in (torch.float32, torch.bfloat16):
        for nesterov in (True, False):
            # shapes of one launch: a tile cut mid-tensor, a 3-D stack, one short tile
            shapes = [(24, 512), (2, 3, 768), (5, 256), (24, 512)]
            grouped(Int4Codec(16), shapes, grad_dtype, nesterov, gradient)
        grouped(Int4Codec(256), [(3, 4096), (1, 8192)], grad_dtype, True, gradient)
    for block, shape, stacked in [
        (16, (64, 512), False),
        (8, (3, 40, 256), True),  # a stack: leading dim of same-shape parameters
        (256, (4, 4096), False),  # one super-block per program
        (2, (16, 96), False),  # 128 super-blocks per program, a partial tile
    ]:
        for grad_dtype in (torch.float32, torch.bfloat16):
            for nesterov in (True, False):
                steps(Int4Codec(block), shape, grad_dtype, nesterov, stacked)
    through_the_optimizer()
    refused()
    print("OK")


if __name__ == "__main__":
    main()
