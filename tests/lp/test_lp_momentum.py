"""Stage 1 of MuonLP (muon_plugin.lp.momentum): same-shape momenta updated as one stack equal
the per-parameter updates bit for bit, for every format, in one process and on DTensor shards
(gloo, 2 spawned processes: FSDP2 rows, uneven rows, and column shards)."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch
from dist_utils import run_distributed
from lp_support import DTYPES, KWARGS, seed_of
from torch import nn

from muon_plugin.functional import MomentumStorage
from muon_plugin.lp import (
    QUANTIZED,
    Int8Codec,
    MomentumCodec,
    MuonLP,
    QuantizedMomentum,
    codec_for,
)
from muon_plugin.lp.momentum import batches, update_quantized_

pytest.importorskip("torchao")

BLOCKS = {"bf16": 0, "int8": 256, "int4": 16, "fp8": 256}


def _one_at_a_time_(grads, momenta, momentum, nesterov, kernels=None):
    return [m.update_(g, momentum, nesterov) for g, m in zip(grads, momenta, strict=True)]


PER_PARAMETER = MomentumStorage(
    _one_at_a_time_, QuantizedMomentum.snapshot, QuantizedMomentum.restore_
)
"""The reference: every momentum updated on its own."""


class PerParameterLP(MuonLP):
    momentum_storage = PER_PARAMETER


def count_stacks(monkeypatch) -> list[int]:
    """The sizes of the stacks ``update_batch_`` is called with, from now on."""
    sizes: list[int] = []
    original = MomentumCodec.update_batch_

    def spy(self, states, *args, **kwargs):
        sizes.append(len(states))
        return original(self, states, *args, **kwargs)

    monkeypatch.setattr(MomentumCodec, "update_batch_", spy)
    return sizes


def momenta(kind: str, shapes, seed: int = 0) -> list[QuantizedMomentum]:
    """Momenta of plain parameters of ``shapes``, with non-zero state."""
    out = []
    for i, shape in enumerate(shapes):
        codec = codec_for(kind, BLOCKS[kind])
        p = torch.zeros(shape)
        state = codec.zeros(p)
        gen = torch.Generator().manual_seed(seed_of(seed, i))
        codec.encode_(state, torch.randn(shape, generator=gen))
        out.append(QuantizedMomentum(codec, state, p, False))
    return out


def copies(ms: list[QuantizedMomentum]) -> list[QuantizedMomentum]:
    return [
        QuantizedMomentum(m.codec, {k: v.clone() for k, v in m.state.items()}, m.param, False)
        for m in ms
    ]


SHAPES = [(256, 256), (64, 512), (256, 256), (2, 32, 256), (256, 256), (2, 32, 256), (64, 512)]


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_stacked_update_equals_one_at_a_time(kind, nesterov):
    batched = momenta(kind, SHAPES)
    alone = copies(batched)
    for step in range(3):
        gen = torch.Generator().manual_seed(seed_of(kind, step))
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        grads[1] = grads[1].bfloat16()  # its own stack: another gradient dtype
        got = update_quantized_(grads, batched, 0.95, nesterov)
        want = _one_at_a_time_(grads, alone, 0.95, nesterov)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.shape == b.shape and torch.equal(a, b), (kind, step, i)
        for i, (m, ref) in enumerate(zip(batched, alone, strict=True)):
            for key in m.state:
                assert torch.equal(m.state[key], ref.state[key]), (kind, step, i, key)


class _FusedWide(Int8Codec):
    """int8 whose "fused kernel" (stand-in: the per-parameter update, bf16 directions) takes
    the 512-column momenta; records each launch's shapes."""

    launches: ClassVar[list[list[tuple[int, ...]]]] = []

    def fused_applies(self, state, grad, kernels):
        return grad.shape[-1] == 512

    def fused_update_(self, states, grads, momentum, nesterov, direction_dtype=torch.bfloat16):
        self.launches.append([tuple(g.shape) for g in grads])
        plain = Int8Codec(self.block_size)
        return [
            plain.update_(st, g, momentum, nesterov).to(direction_dtype)
            for st, g in zip(states, grads, strict=True)
        ]


def test_fused_momenta_take_one_launch_the_rest_stacks(monkeypatch):
    """Momenta a fused kernel takes go to one launch per codec and grad dtype, whatever their
    shapes, in list order, their directions in bf16; the others are stacked as before; every
    result lands at its own position."""
    stacks = count_stacks(monkeypatch)
    codec = _FusedWide(256)
    shapes = [(256, 256), (64, 512), (256, 256), (2, 32, 512), (16, 512), (64, 512)]
    reference = momenta("int8", shapes)  # plain int8: torchao's ops one at a time
    fused = [QuantizedMomentum(codec, m.state, m.param, False) for m in copies(reference)]
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    grads[4] = grads[4].bfloat16()  # another grad dtype: a launch of its own
    _FusedWide.launches.clear()
    got = update_quantized_(grads, fused, 0.95, True)
    want = _one_at_a_time_(grads, reference, 0.95, True)
    assert _FusedWide.launches == [[(64, 512), (2, 32, 512), (64, 512)], [(16, 512)]]
    assert stacks == [2]  # the two (256, 256) momenta
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        expected = b.bfloat16() if shapes[i][-1] == 512 else b
        assert a.dtype == expected.dtype and torch.equal(a, expected), i
        for key in fused[i].state:
            assert torch.equal(fused[i].state[key], reference[i].state[key]), (i, key)


def test_batches_group_same_format_and_shape_in_order():
    ms = momenta("int8", SHAPES) + momenta("int4", [(256, 256)])
    grads = [torch.zeros(m.param.shape) for m in ms]
    grads[6] = grads[6].bfloat16()
    assert batches(grads, ms) == [[0, 2, 4], [1], [3, 5], [6], [7]]


def test_stacks_are_cut_at_max_stack_numel(monkeypatch):
    """No stack holds more than MAX_STACK_NUMEL elements (one larger parameter goes alone)."""
    import muon_plugin.lp.momentum as stage1

    ms = momenta("int4", [(256, 256)] * 5 + [(512, 512)] * 2)
    grads = [torch.zeros(m.param.shape) for m in ms]
    monkeypatch.setattr(stage1, "MAX_STACK_NUMEL", 2 * 256 * 256)
    assert batches(grads, ms) == [[0, 1], [2, 3], [4], [5], [6]]


def test_muonlp_steps_equal_per_parameter_steps(monkeypatch):
    """Whole MuonLP steps with stacked momentum equal steps updating one at a time (and the
    default storage is the stacked one)."""
    assert MuonLP.momentum_storage is QUANTIZED
    stacks = count_stacks(monkeypatch)
    for kind in DTYPES:
        stacks.clear()
        models = [nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4)))]
        models.append(copy.deepcopy(models[0]))
        opts = [
            cls(list(m.parameters()), state_dtype=kind, **KWARGS)
            for cls, m in zip((MuonLP, PerParameterLP), models, strict=True)
        ]
        for step in range(3):
            for model, opt in zip(models, opts, strict=True):
                for i, p in enumerate(model.parameters()):
                    gen = torch.Generator().manual_seed(seed_of(i, step))
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
        assert stacks == [4, 4, 4], (kind, stacks)  # one stack a step
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p, q), kind
            for key, value in opts[0].state[p].items():
                assert torch.equal(value, opts[1].state[q][key]), (kind, key)


# ---------------------------------------------------------------------- DTensor shards (gloo)

# Three stacks: rows split evenly, rows split unevenly (127 = 64 + 63), and a wide one that the
# column-sharded layout splits at block boundaries.
DIST_SHAPES = [(128, 512)] * 3 + [(127, 512)] * 2 + [(16, 1024)] * 2


def _dist_params(mesh, placement, seed: int) -> list[nn.Parameter]:
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    return [
        nn.Parameter(distribute_tensor(torch.randn(s, generator=gen) * 0.05, mesh, [placement]))
        for s in DIST_SHAPES
    ]


def _set_grads(params, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(seed_of(i, step))
        g = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)


def _dist_job(rank: int, ws: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (ws,))
    stacks = count_stacks(pytest.MonkeyPatch())
    for placement in (Shard(0), Shard(1)):
        for kind in DTYPES:
            stacks.clear()
            params = [_dist_params(mesh, placement, 0) for _ in range(2)]
            opts = [
                cls(ps, state_dtype=kind, block_size=BLOCKS[kind] or None, **KWARGS)
                for cls, ps in zip((MuonLP, PerParameterLP), params, strict=True)
            ]
            for step in range(3):
                for ps, opt in zip(params, opts, strict=True):
                    _set_grads(ps, step)
                    opt.step()
            label = f"{kind} {placement}"
            assert stacks == [3, 2, 2] * 3, (label, stacks)
            for i, (p, q) in enumerate(zip(*params, strict=True)):
                assert opts[0].state_format(p).kind == kind, (label, i)
                assert torch.equal(p.to_local(), q.to_local()), (label, i)
                for key, value in opts[0].state[p].items():
                    other = opts[1].state[q][key]
                    assert torch.equal(value.to_local(), other.to_local()), (label, i, key)


def test_stacked_update_equals_one_at_a_time_on_dtensor_shards():
    run_distributed(_dist_job, 2)
