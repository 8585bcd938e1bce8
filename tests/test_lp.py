"""MuonLP: low-precision Muon momentum (bf16, int8, int4, fp8) that trains, shards and checkpoints.

Single-process tests train a small MLP, compare against fp32-state ``MuonForeach``, round-trip
state dicts and convert between formats. The distributed test (gloo, 2 spawned processes, FSDP2)
checks that sharded state equals the single-process state bit for bit, round-trips through DCP,
and loads into another layout (TP-style ``Shard(1)``, and plain tensors in one process).
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from muon_plugin import MuonForeach
from muon_plugin.lp import MuonLP
from muon_plugin.lp_rank1 import U_KEY, W_KEY
from muon_plugin.lp_state import (
    ABSMAX_KEY,
    BASES_KEY,
    CODES_KEY,
    PLAIN_FP8,
    SCALE_CODES_KEY,
    SCALES_KEY,
    StateFormat,
    key_placements,
)

torchao = pytest.importorskip("torchao")

DTYPES = ("bf16", "int8", "int4", "fp8")
CODE_DTYPES = {"int8": torch.uint8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
BYTES_PER_PARAM = {"bf16": 2.0, "int8": 1.1, "int4": 0.6, "fp8": 1.1}  # including scales
# Tolerances against fp32-state MuonForeach fed the same gradients (relative Frobenius errors,
# about 2x the values measured on CPU). Step 1 is exact for every dtype: the momentum is updated
# in fp32 before it is stored, so the first direction is the fp32 one.
# - the parameter change after 3 steps (bf16 orthogonalization amplifies the momentum error);
#   measured bf16 0.010, int8 0.013, fp8 0.022, int4 0.062 (block-32 bf16-absmax int4: 0.068):
UPDATE_TOLERANCE = {"bf16": 0.02, "int8": 0.03, "fp8": 0.05, "int4": 0.13}
# - the stored momentum itself, after 3 steps; measured bf16 0.0023, int8 0.015, fp8 0.037,
#   int4 0.116 (block-32 bf16-absmax int4: 0.124; 0.21 with torchao's 4-bit dynamic-tree map;
#   the earlier Lloyd-Max map was lower):
MOMENTUM_TOLERANCE = {"bf16": 0.005, "int8": 0.03, "fp8": 0.06, "int4": 0.24}
KWARGS = dict(lr=0.02, wd=0.01)


# ---------------------------------------------------------------------- helpers


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def mlp(seed: int = 0) -> nn.Sequential:
    """Three Muon matrices that every state dtype quantizes (>= 4096 elements, 256 columns)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16)
    )


def groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    vecs = [(n, p) for n, p in named if p.ndim < 2]
    return [
        {"params": [p for _, p in mats], "param_names": [n for n, _ in mats]},
        {"params": [p for _, p in vecs], "param_names": [n for n, _ in vecs], "algorithm": "adamw"},
    ]


def data(n: int = 512):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 256, generator=gen)
    w = torch.randn(256, 16, generator=gen) / 16
    return x, torch.tanh(x @ w)


def random_grads(params, step: int) -> None:
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(seed_of(i, step))
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def muon_params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]


# ---------------------------------------------------------------------- construction


def test_bad_state_dtype_and_block_size_raise():
    params = list(mlp().parameters())
    with pytest.raises(ValueError, match="unknown state_dtype 'int2'"):
        MuonLP(params, state_dtype="int2")
    for bad in (0, -128, 2.5, True, "256"):
        with pytest.raises(ValueError, match="block_size must be a positive integer"):
            MuonLP(params, state_dtype="int8", block_size=bad)
    with pytest.raises(ValueError, match="block_size must be even"):
        MuonLP(params, state_dtype="int4", block_size=127)
    # The usual Muon validation still applies.
    with pytest.raises(ValueError, match="lr must be"):
        MuonLP(params, state_dtype="int8", lr=-1.0)


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_drop_in_for_muon_foreach_kwargs(state_dtype):
    # A non-default block size (int4's super-block of 16 blocks must divide the 256 columns).
    block_size = {"bf16": None, "int8": 64, "fp8": 64, "int4": 8}[state_dtype]
    model = mlp()
    opt = MuonLP(
        groups(model),
        lr=0.01,
        wd=0.1,
        momentum=0.9,
        nesterov=False,
        ns_steps=6,
        orthogonalization_strategy="newton_schulz",
        lr_adjust="match_rms_adamw",
        state_dtype=state_dtype,
        block_size=block_size,
    )
    random_grads(list(model.parameters()), 0)
    opt.step()
    for p in muon_params(opt):
        fmt = opt.state_format(p)
        assert fmt.kind == state_dtype and set(opt.state[p]) == set(fmt.keys)
        if fmt.quantized:
            assert fmt.block_size == block_size
            blocks = (*p.shape[:-1], p.shape[-1] // block_size)
            assert opt.state[p][fmt.scales_key].shape == blocks


def test_unblockable_shapes_fall_back_to_bf16_with_one_warning(caplog):
    shapes = {"ok": (64, 256), "tiny": (8, 256), "ragged": (64, 100), "conv": (64, 32, 3, 3)}
    params = [nn.Parameter(torch.randn(s)) for s in shapes.values()]
    group = {"params": params, "param_names": list(shapes)}
    with caplog.at_level(logging.WARNING, logger="muon_plugin.lp"):
        opt = MuonLP([group], state_dtype="int8")
    records = [r for r in caplog.records if r.name == "muon_plugin.lp"]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    for name in ("'tiny'", "'ragged'", "'conv'"):
        assert name in message
    assert "'ok'" not in message
    kinds = {n: opt.state_format(p).kind for n, p in zip(shapes, params, strict=True)}
    assert kinds == {"ok": "int8", "tiny": "bf16", "ragged": "bf16", "conv": "bf16"}
    for step in range(2):
        random_grads(params, step)
        opt.step()
    assert opt.state[params[1]]["momentum_buffer"].dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in params)
    # Constructing was the only report; stepping adds none.
    assert len([r for r in caplog.records if r.name == "muon_plugin.lp"]) == 1


def test_adamw_groups_keep_full_precision_state():
    model = mlp()
    opt = MuonLP(groups(model), state_dtype="int4")
    random_grads(list(model.parameters()), 0)
    opt.step()
    for p in model.parameters():
        if p.ndim == 1:
            assert opt.state[p]["exp_avg"].dtype == torch.float32
            assert opt.state[p]["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_state_bytes_per_parameter(state_dtype):
    model = mlp()
    opt = MuonLP(groups(model), state_dtype=state_dtype)
    random_grads(list(model.parameters()), 0)
    opt.step()
    nbytes, numel = opt.state_bytes()
    assert numel == sum(p.numel() for p in muon_params(opt))
    assert nbytes / numel <= BYTES_PER_PARAM[state_dtype]
    if state_dtype == "int4":  # codes, scale codes and bases, all counted
        assert nbytes / numel == 0.5 + 1 / 16 + 2 / 256
    for p in muon_params(opt):
        if state_dtype != "bf16":
            assert opt.state[p][CODES_KEY].dtype == CODE_DTYPES[state_dtype]


# ---------------------------------------------------------------------- training


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_twenty_steps_reduce_the_loss(state_dtype):
    model = mlp()
    opt = MuonLP(groups(model), state_dtype=state_dtype, **KWARGS)
    assert all(opt.state_format(p).kind == state_dtype for p in muon_params(opt))
    x, y = data()
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(b < a * 1.05 for a, b in zip(losses[5:], losses[6:], strict=False)), losses


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_first_steps_close_to_fp32_state_muon(state_dtype):
    ref_model, model = mlp(), mlp()
    ref = MuonForeach(groups(ref_model), **KWARGS)
    opt = MuonLP(groups(model), state_dtype=state_dtype, **KWARGS)
    start = [p.detach().clone() for p in muon_params(opt)]
    for step in range(3):
        random_grads(list(ref_model.parameters()), step)
        random_grads(list(model.parameters()), step)
        ref.step()
        opt.step()
        for p, q, p0 in zip(muon_params(opt), muon_params(ref), start, strict=True):
            err = rel_err(p - p0, q - p0)
            if step == 0:
                # The momentum is updated in fp32 and only then stored: step 1 is exact.
                assert err == 0.0, err
            elif step == 2:
                assert err < UPDATE_TOLERANCE[state_dtype], (state_dtype, err)
        # The stored momentum is the fp32 momentum, up to the format's precision.
        for p, q in zip(muon_params(opt), muon_params(ref), strict=True):
            m_err = rel_err(opt.momentum(p), ref.state[q]["momentum_buffer"])
            assert m_err < MOMENTUM_TOLERANCE[state_dtype], (state_dtype, m_err)


@pytest.mark.parametrize("state_dtype", ["int8", "int4", "fp8"])
def test_bf16_parameters(state_dtype):
    params = [nn.Parameter(torch.randn(64, 256, dtype=torch.bfloat16) * 0.02)]
    opt = MuonLP(params, state_dtype=state_dtype, **KWARGS)
    for step in range(3):
        random_grads(params, step)
        opt.step()
    assert params[0].dtype == torch.bfloat16 and torch.isfinite(params[0]).all()
    assert opt.state[params[0]][CODES_KEY].dtype == CODE_DTYPES[state_dtype]


def test_compile_matches_eager():
    """compile=True compiles the state update too: the same codes, the same momentum."""
    for state_dtype in ("int8", "int4"):
        eager_model, compiled_model = mlp(), mlp()
        eager = MuonLP(groups(eager_model), state_dtype=state_dtype, **KWARGS)
        compiled = MuonLP(groups(compiled_model), state_dtype=state_dtype, compile=True, **KWARGS)
        start = [p.detach().clone() for p in muon_params(eager)]
        for step in range(3):
            random_grads(list(eager_model.parameters()), step)
            random_grads(list(compiled_model.parameters()), step)
            eager.step()
            compiled.step()
        for p, q, p0 in zip(muon_params(eager), muon_params(compiled), start, strict=True):
            # The momentum depends on the gradients only. int8: the same codes, scales up to
            # rounding. int4: requantization is bit for bit (test_int4_compiled_requantization_
            # is_bit_for_bit), but the fp32 lerp before it is not (eager CPU lerp uses FMA,
            # inductor's CPU code does not contract), so an element within an ulp of a cell
            # edge may take the neighbouring code (1 code byte of 67,584 here).
            assert set(eager.state[p]) == set(compiled.state[q])
            for key, value in eager.state[p].items():
                other = compiled.state[q][key]
                if state_dtype == "int4":
                    assert (value != other).float().mean() < 1e-3, key
                elif key == SCALES_KEY:
                    assert torch.allclose(value, other), key
                else:
                    assert torch.equal(value, other), key
            assert rel_err(compiled.momentum(q), eager.momentum(p)) < 1e-2
            # The compiled orthogonalization fuses bf16 ops: equal up to bf16 noise.
            assert rel_err(q - p0, p - p0) < 4e-2


# ---------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_state_dict_round_trip(state_dtype):
    model = mlp()
    opt = MuonLP(groups(model), state_dtype=state_dtype, **KWARGS)
    for step in range(3):
        random_grads(list(model.parameters()), step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    model2 = copy.deepcopy(model)
    opt2 = MuonLP(groups(model2), state_dtype=state_dtype, **KWARGS)
    opt2.load_state_dict(saved)
    for p, q in zip(muon_params(opt), muon_params(opt2), strict=True):
        for key, value in opt.state[p].items():
            # torch.optim would cast codes and bf16 buffers to the fp32 parameter dtype.
            assert opt2.state[q][key].dtype == value.dtype
            assert torch.equal(opt2.state[q][key], value)
    random_grads(list(model.parameters()), 3)
    random_grads(list(model2.parameters()), 3)
    opt.step()
    opt2.step()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


CONVERSIONS = [
    ("fp32", "int8"),
    ("fp32", "bf16"),
    ("int8", "int4"),
    ("int4", "fp8"),
    ("fp8", "bf16"),
    ("bf16", "int8"),
    ("int8/64", "int8"),
    ("int4/8", "int4"),
]


def make_optimizer(model, spec: str):
    if spec == "fp32":
        return MuonForeach(groups(model), **KWARGS)
    kind, _, block = spec.partition("/")
    return MuonLP(groups(model), state_dtype=kind, block_size=int(block) if block else None)


@pytest.mark.parametrize(("source", "target"), CONVERSIONS)
def test_load_state_dict_converts_formats(source, target):
    """Momentum saved in another format (or by MuonForeach) is requantized on load."""
    model = mlp()
    src = make_optimizer(model, source)
    for step in range(2):
        random_grads(list(model.parameters()), step)
        src.step()
    dst = make_optimizer(copy.deepcopy(model), target)
    dst.load_state_dict(copy.deepcopy(src.state_dict()))
    for p, q in zip(muon_params(src), muon_params(dst), strict=True):
        fmt = dst.state_format(q)
        assert set(dst.state[q]) == set(fmt.keys)
        before = src.state[p]["momentum_buffer"] if source == "fp32" else src.momentum(p)
        # One requantization of already-quantized momentum: within the target's tolerance.
        budget = MOMENTUM_TOLERANCE[fmt.kind]
        assert rel_err(dst.momentum(q), before) < budget


def test_loaded_state_can_be_stepped_from_muon_foreach_checkpoint():
    model = mlp()
    src = MuonForeach(groups(model), **KWARGS)
    random_grads(list(model.parameters()), 0)
    src.step()
    dst = MuonLP(groups(model), state_dtype="int8", **KWARGS)
    dst.load_state_dict(src.state_dict())
    random_grads(list(model.parameters()), 1)
    dst.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------- optional dependency


def test_without_torchao_only_int8_and_fp8_fail():
    """int8 / fp8 need torchao; int4 and bf16 are plain torch."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torchao"] = None  # as if torchao were not installed
        import torch
        import muon_plugin
        from muon_plugin import MuonForeach, MuonLP
        p = torch.nn.Parameter(torch.randn(64, 256))
        for dtype in ("int8", "fp8"):
            try:
                MuonLP([p], state_dtype=dtype)
            except ImportError as e:
                assert "pip install 'muon_plugin[lp]'" in str(e), str(e)
            else:
                raise AssertionError(f"{dtype}: no ImportError without torchao")
        for opt in (MuonLP([p], state_dtype=d) for d in ("bf16", "int4")):
            p.grad = torch.randn(64, 256)
            opt.step()
        for opt in (MuonForeach([p]),):
            p.grad = torch.randn(64, 256)
            opt.step()
        assert "torchao" not in [m for m, v in sys.modules.items() if v is not None]
        print("OK")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------------- distributed (gloo)

DIST_RUNS = (("int8", False), ("int4", False), ("fp8", True), ("bf16", False))
DIST_SHAPES = {"w1": (128, 512), "w2": (127, 512), "head": (8, 127), "bias": (512,)}


class Bag(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in DIST_SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen) * 0.05))


def bag_groups(named) -> list[dict]:
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    vecs = [(n, p) for n, p in named if p.ndim < 2]
    return [
        {"params": [p for _, p in mats], "param_names": [n for n, _ in mats]},
        {"params": [p for _, p in vecs], "param_names": [n for n, _ in vecs], "algorithm": "adamw"},
    ]


def global_grad(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed_of(name, step))
    return torch.randn(DIST_SHAPES[name], generator=gen)


def set_bag_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = global_grad(name, step)
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.dtype in (torch.uint8, torch.float8_e4m3fn):
        # gloo cannot gather these dtypes: gather the bytes as int8.
        as_int8 = DTensor.from_local(
            t.to_local().view(torch.int8),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
        return as_int8.full_tensor().view(t.dtype)
    return t.full_tensor()


def snapshot(model: nn.Module, opt: MuonLP) -> dict[str, torch.Tensor]:
    out = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if p.ndim >= 2:
            out[f"{n}.momentum"] = full(opt.momentum(p)).clone()
            for key, value in opt.state[p].items():
                out[f"{n}.{key}"] = full(value).clone()
    return out


def assert_same(got: dict, want: dict, label: str, param_tol: float = 0.0) -> None:
    """Equal state; equal parameters (up to ``param_tol``, for compiled orthogonalization)."""
    for key in want:
        tol = param_tol if key in DIST_SHAPES else 0.0
        if key == "bias":
            tol = max(tol, 1e-6)  # AdamW's CPU kernels round shard tails differently
        a, b = got[key], want[key]
        ok = torch.equal(a, b) if tol == 0.0 else torch.allclose(a, b, rtol=tol, atol=tol)
        assert ok, f"{label}: {key} differs by {(a.float() - b.float()).abs().max().item()}"


def dist_checkpoint_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_state(model, opt) -> dict:
    """The model and optimizer state as torchtitan hands it to DCP."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = dist_checkpoint_options()
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }


def dcp_save(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(dcp_state(model, opt), checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=dist_checkpoint_options())


def dist_job(rank: int, ws: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    for state_dtype, compile_ in DIST_RUNS:
        label = f"{state_dtype} compile={compile_}"
        kwargs = dict(state_dtype=state_dtype, compile=compile_, **KWARGS)

        def fsdp_model(seed: int) -> nn.Module:
            model = Bag(seed)
            fully_shard(model, mesh=mesh)
            return model

        # 1. FSDP2 (Shard(0), uneven for w2) against one process fed the gathered gradients.
        model, ref_model = fsdp_model(0), Bag(0)
        opt = MuonLP(bag_groups(list(model.named_parameters())), **kwargs)
        ref = MuonLP(bag_groups(list(ref_model.named_parameters())), **kwargs)
        for step in range(3):
            set_bag_grads(model, step)
            set_bag_grads(ref_model, step)
            opt.step()
            ref.step()
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            fmt = opt.state_format(p)
            assert fmt.kind == ("bf16" if name == "head" else state_dtype), (label, name, fmt)
            for key, value in opt.state[p].items():
                # Sharded like the parameter: same mesh and placements, blocks of its rows
                # (fp8's rank-1 factors: like its rows, u, or replicated like its columns, w).
                assert isinstance(value, DTensor), key
                assert tuple(value.placements) == key_placements(p, key), key
                rows = p.to_local().shape[0] if key != W_KEY else p.shape[1]
                assert value.to_local().shape[0] == rows, key
        saved = snapshot(model, opt)
        # Inductor compiles the orthogonalization of a shard-sized stack on one rank and of a
        # whole-model stack here: bf16 roundings may differ. The momentum never does.
        tol = 5e-4 if compile_ else 0.0
        assert_same(saved, snapshot(ref_model, ref), f"{label} FSDP2 vs one process", tol)

        # 2. DCP save, one more step; a fresh FSDP2 optimizer loads and takes the same step.
        path = os.path.join(root, state_dtype)
        dcp_save(model, opt, path)
        set_bag_grads(model, 3)
        opt.step()
        after = snapshot(model, opt)
        model2 = fsdp_model(1)
        opt2 = MuonLP(bag_groups(list(model2.named_parameters())), **kwargs)
        dcp_load(model2, opt2, path)
        assert_same(snapshot(model2, opt2), saved, f"{label} DCP load")
        set_bag_grads(model2, 3)
        opt2.step()
        assert_same(snapshot(model2, opt2), after, f"{label} step after DCP load")

        # 3. Another layout: every parameter Shard(1) (TP-rowwise-like), loaded from the
        #    FSDP2 checkpoint; blocks run along rows, so codes and scales just move.
        model3 = Bag(2)
        for name, p in list(model3.named_parameters()):
            placement = Shard(1) if p.ndim >= 2 else Shard(0)
            dt = distribute_tensor(p.detach(), mesh, [placement])
            model3.register_parameter(name, nn.Parameter(dt))
        opt3 = MuonLP(bag_groups(list(model3.named_parameters())), **kwargs)
        dcp_load(model3, opt3, path)
        for p in model3.parameters():
            if p.ndim >= 2:
                for key, value in opt3.state[p].items():
                    assert tuple(value.placements) == key_placements(p, key), key
        assert_same(snapshot(model3, opt3), saved, f"{label} Shard(1) load")
        set_bag_grads(model3, 3)
        opt3.step()
        assert_same(snapshot(model3, opt3), after, f"{label} step after Shard(1) load", tol)
        if rank == 0:
            torch.save({"saved": saved, "after": after}, os.path.join(root, f"{state_dtype}.pt"))


def test_fsdp2_dcp_and_layout_change(tmp_path):
    """FSDP2 over 2 gloo ranks: state equals one process's, DCP round trip, other layouts."""
    run_distributed(dist_job, 2, str(tmp_path))
    # And plain tensors in this (non-distributed) process, from the 2-rank FSDP2 checkpoint.
    # Eager here: the load does not depend on compile, and compiling once more in this
    # process would only add Inductor's compile time (compile=True ran on the ranks above).
    for state_dtype, compile_ in DIST_RUNS:
        expected = torch.load(tmp_path / f"{state_dtype}.pt", weights_only=True)
        model = Bag(3)
        opt = MuonLP(bag_groups(list(model.named_parameters())), state_dtype=state_dtype, **KWARGS)
        with pytest.warns(UserWarning, match="single process"):
            dcp_load(model, opt, str(tmp_path / state_dtype))
        assert_same(snapshot(model, opt), expected["saved"], f"{state_dtype} plain load")
        set_bag_grads(model, 3)
        opt.step()
        tol = 5e-4 if compile_ else 0.0
        assert_same(snapshot(model, opt), expected["after"], f"{state_dtype} plain step", tol)


def test_state_format_layouts():
    layout = StateFormat("int4", 32).layout((3, 64, 1024))
    assert layout == {
        CODES_KEY: ((3, 64, 512), torch.uint8),
        SCALE_CODES_KEY: ((3, 64, 32), torch.uint8),
        BASES_KEY: ((3, 64, 2), torch.bfloat16),  # a super-block: 16 blocks of 32
    }
    assert StateFormat("int8", 128).layout((3, 64, 512))[SCALES_KEY] == ((3, 64, 4), torch.float32)
    # Default int4 block: 16 elements, an 8-bit scale code each, a bf16 base per 256 elements.
    opt = MuonLP([nn.Parameter(torch.zeros(64, 256))], state_dtype="int4")
    assert opt.block_size == 16


def test_int4_bytes_per_parameter_and_fallback_below_a_super_block(caplog):
    """0.5 + 1/16 + 2/256 = 0.5703 bytes per element; a last dim that is not a multiple of a
    super-block (16 blocks of 16 = 256 elements) keeps bf16 momentum, saying why."""
    shapes = {"ok": (64, 512), "narrow": (64, 128), "ragged": (64, 272)}
    params = [nn.Parameter(torch.randn(s)) for s in shapes.values()]
    with caplog.at_level(logging.WARNING, logger="muon_plugin.lp"):
        opt = MuonLP([{"params": params, "param_names": list(shapes)}], state_dtype="int4")
    message = "\n".join(r.getMessage() for r in caplog.records if r.name == "muon_plugin.lp")
    for name, cols in (("narrow", 128), ("ragged", 272)):
        reason = f"last dim {cols} not divisible by 256 (an int4 super-block: 16 blocks of "
        assert f"'{name}'" in message and reason + "block_size 16)" in message, message
    assert "'ok'" not in message
    random_grads(params, 0)
    opt.step()
    state = opt.state[params[0]]
    assert set(state) == {CODES_KEY, SCALE_CODES_KEY, BASES_KEY}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    assert nbytes / params[0].numel() == 0.5 + 1 / 16 + 2 / 256
    # With block_size 8 a super-block is 128 elements: the narrow one is quantized too.
    opt8 = MuonLP([params[1]], state_dtype="int4", block_size=8)
    assert opt8.state_format(params[1]) == StateFormat("int4", 8)


# ---------------------------------------------------------------------- the int4 code

# The decoded scale of code k, 2**(-k/32) of the base (rounded to fp32); 255: an all-zero block.
SCALE_FACTORS = torch.tensor([2.0 ** (-k / 32) for k in range(255)] + [0.0])


def zero_state(fmt: StateFormat, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Zero-filled plain state tensors of ``fmt`` for a parameter of ``shape``."""
    return {k: torch.zeros(s, dtype=d) for k, (s, d) in fmt.layout(shape).items()}


def int4_roundtrip(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, dict]:
    """(dequantized x, the int4 state tensors) through MuonLP's int4 state format."""
    fmt = StateFormat("int4", block_size)
    state = zero_state(fmt, tuple(x.shape))
    fmt.write(state, x)
    return fmt.read(state, tuple(x.shape)), state


def bf16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 >= x (fp32, x >= 0), as bf16."""
    up = x.to(torch.bfloat16)
    return torch.where(up.float() < x, up.nextafter(up.new_tensor(math.inf)), up)


def graded_blocks(rows: int, cols: int, block_size: int, octaves: float, seed: int = 0):
    """Gaussian blocks, each scaled by 2**-u with u uniform in [0, octaves): block absmaxes
    spread over the whole range of the scale codes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols // block_size, block_size, generator=gen)
    u = torch.rand(rows, cols // block_size, 1, generator=gen) * octaves
    return (x * torch.exp2(-u)).view(rows, cols)


def boundary_blocks(base: float = 3.0) -> torch.Tensor:
    """Super-blocks (rows of 256: 16 blocks of 16) whose first block's absmax is ``base`` (a
    bf16 value, so the super-block's base) and whose other blocks' absmaxes sit on the
    boundaries between scale codes (``base * midpoint`` in fp32) or one ulp either side: the
    hardest inputs for the scale-code search."""
    from muon_plugin.lp_state import INT4_SCALE_MIDPOINTS

    edges = torch.tensor(INT4_SCALE_MIDPOINTS) * torch.tensor(base)
    targets = torch.stack([edges.nextafter(torch.tensor(0.0)), edges, edges.nextafter(edges * 2)])
    targets = torch.cat([targets.flatten(), torch.full((-targets.numel() % 15,), base)])
    x = torch.zeros(targets.numel() // 15, 16, 16)
    x[:, 0, 0] = base
    x[:, 1:, 0] = targets.view(-1, 15)
    x[:, :, 1] = -0.5 * x[:, :, 0]  # and a smaller element of the other sign
    return x.view(-1, 256)


def decoded_scales(state: dict, block_size: int) -> torch.Tensor:
    """Each block's scale (one a row), decoded from the state independently of lp_state."""
    k = state[SCALE_CODES_KEY].reshape(-1).long()
    base = state[BASES_KEY].float().reshape(-1).repeat_interleave(16)
    return (base * SCALE_FACTORS[k]).view(-1, 1)


def test_int4_levels_are_uniform_mid_rise():
    """Code c is the centre of cell c of 16 equal cells spanning [-1, 1]."""
    from muon_plugin.lp_state import INT4_LEVELS

    levels = torch.tensor(INT4_LEVELS, dtype=torch.float64)
    edges = torch.linspace(-1, 1, 17, dtype=torch.float64)
    assert torch.equal(levels, (edges[1:] + edges[:-1]) / 2)
    assert torch.equal(levels, -levels.flip(0))


@pytest.mark.parametrize("block_size", [16, 32])
def test_int4_roundtrip_is_nearest_level_of_decoded_scale(block_size):
    """Per super-block: base = absmax rounded up to bf16. Per block: scale = base * 2**(-k/32).
    Per element: the nearest of the 16 levels times the scale, exactly (brute force), so the
    error is at most 1/16 of the scale inside the outermost levels, and elements beyond 15/16
    of the scale take the outermost."""
    from muon_plugin.lp_state import INT4_LEVELS

    torch.manual_seed(0)
    gauss = torch.randn(64, 1024)
    heavy = torch.distributions.StudentT(4.0).sample((64, 1024))
    graded = graded_blocks(64, 1024, block_size, octaves=9.0)
    levels = torch.tensor(INT4_LEVELS)
    for x in (gauss, heavy * 1e-3, gauss * 1e30, graded):
        y, state = int4_roundtrip(x, block_size)
        supers = x.view(-1, 16 * block_size).abs().amax(-1)
        assert torch.equal(state[BASES_KEY].view(-1), bf16_up(supers))
        # The largest block of each super-block gets code 0: its scale is the base.
        absmax = x.view(-1, 16, block_size).abs().amax(-1)
        codes = state[SCALE_CODES_KEY].view(-1, 16).long()
        assert torch.all(codes.gather(-1, absmax.argmax(-1, keepdim=True)) == 0)
        blocks = x.view(-1, block_size)
        scale = decoded_scales(state, block_size)
        cand = (levels.view(1, 1, -1) * scale.unsqueeze(-1)).expand(*blocks.shape, 16)
        best = cand.gather(-1, (blocks.unsqueeze(-1) - cand).abs().argmin(-1, keepdim=True))
        assert torch.equal(y.view(-1, block_size), best.squeeze(-1))
        err = (y - x).view(-1, block_size).abs()
        inside = blocks.abs() <= 15 / 16 * scale
        assert torch.all(err[inside] <= (scale / 16).expand_as(blocks)[inside] * (1 + 1e-6))
        assert torch.equal(
            y.view(-1, block_size).abs()[~inside], (15 / 16 * scale).expand_as(blocks)[~inside]
        )
    rel = lambda x: (int4_roundtrip(x, block_size)[0] - x).norm().item() / x.norm().item()  # noqa: E731
    # One-shot error on Gaussian blocks: about 8% at block 16 (absmax about 1.8 RMS), 9% at 32.
    assert rel(gauss) < {16: 0.09, 32: 0.10}[block_size], rel(gauss)


def test_int4_scale_code_is_nearest_in_log_domain():
    """k = round(-32 * log2(absmax / base)) against an fp64 reference (up to fp32 rounding at
    the midpoints), 254 for blocks below 2**(-253.5/32) of the base, 255 for all-zero blocks."""
    x = graded_blocks(256, 1024, 16, octaves=9.0, seed=1)
    x[3, 16:32] = 0.0
    _, state = int4_roundtrip(x, 16)
    k = state[SCALE_CODES_KEY].view(-1).long()
    absmax = x.view(-1, 16).abs().amax(-1).double()
    base = state[BASES_KEY].double().view(-1).repeat_interleave(16)
    zero = absmax == 0
    assert torch.all(k[zero] == 255) and zero.sum() == 1
    t = -32 * torch.log2(absmax[~zero] / base[~zero])
    ref = t.round().clamp(max=254).long()
    k = k[~zero]
    near_tie = ((t - t.floor()) - 0.5).abs() < 1e-4
    assert torch.all((k == ref) | near_tie), (k != ref).sum()
    assert torch.all((t - k).abs()[k < 254] <= 0.5 + 1e-4)
    assert torch.all(t[k == 254] >= 253.5 - 1e-4)
    # The data covers the whole range of codes.
    assert k.min() == 0 and (k == 254).sum() > 10 and len(k.unique()) > 250


def test_int4_scale_code_is_exact_at_the_boundaries():
    """k is exactly the number of midpoints above the absmax (``absmax < base * midpoint``,
    both fp32), also for absmaxes on a boundary or one ulp from it."""
    from muon_plugin.lp_state import INT4_SCALE_MIDPOINTS

    x = boundary_blocks()
    _, state = int4_roundtrip(x, 16)
    assert torch.all(state[BASES_KEY].float() == 3.0)
    absmax = x.view(-1, 16).abs().amax(-1)
    edges = torch.tensor(INT4_SCALE_MIDPOINTS) * torch.tensor(3.0)
    expected = (absmax.unsqueeze(-1) < edges).sum(-1)
    k = state[SCALE_CODES_KEY].view(-1).long()
    assert torch.equal(k, expected)
    assert len(k.unique()) == 255  # every code 0..254, each boundary from both sides


def test_int4_zero_and_sign_symmetry():
    x = torch.randn(8, 512)
    x[3] = 0.0  # an all-zero super-block: base 0, every block code 255, exact zeros
    x[5, 32:48] = 0.0  # an all-zero block inside a non-zero super-block: code 255, exact zeros
    y, state = int4_roundtrip(x, 16)
    assert torch.equal(y[3], torch.zeros(512))
    assert torch.equal(state[BASES_KEY][3], torch.zeros(2, dtype=torch.bfloat16))
    assert torch.all(state[SCALE_CODES_KEY][3] == 255)
    assert torch.equal(y[5, 32:48], torch.zeros(16)) and state[SCALE_CODES_KEY][5, 2] == 255
    assert (state[SCALE_CODES_KEY] == 255).sum() == 32 + 1
    assert torch.isfinite(y).all()
    y_neg, state_neg = int4_roundtrip(-x, 16)
    assert torch.equal(y_neg, -y)
    for key in (SCALE_CODES_KEY, BASES_KEY):
        assert torch.equal(state_neg[key], state[key])


def test_int4_tiny_block_in_a_big_super_block():
    """A block below 2**(-253.5/32) of its super-block's base takes code 254 (the smallest
    non-zero scale, base / 245): its elements keep their signs and are within 1/16 of that
    scale; blocks in range keep their own precision."""
    torch.manual_seed(0)
    x = torch.randn(4, 256)
    x[:, 16:32] *= 1e-6  # far below the range of the codes: 254
    x[:, 32:48] *= 3e-2  # about 1/100 of the base, inside the range: a code of its own
    y, state = int4_roundtrip(x, 16)
    codes = state[SCALE_CODES_KEY]
    assert torch.all(codes[:, 1] == 254)
    assert torch.all((codes[:, 2] > 150) & (codes[:, 2] < 254))
    scale = decoded_scales(state, 16).view(4, 16)
    assert torch.allclose(scale[:, 1], state[BASES_KEY].float().view(-1) * 2 ** (-254 / 32))
    tiny, tiny_y = x[:, 16:32], y[:, 16:32]
    assert torch.isfinite(tiny_y).all() and torch.all(tiny_y.sign() == tiny.sign())
    assert torch.all((tiny_y - tiny).abs() <= scale[:, 1:2] / 16 * (1 + 1e-6))
    # The 3e-2 block: its scale within 1.1% of its absmax, a Gaussian block's usual error.
    small, small_y = x[:, 32:48], y[:, 32:48]
    ratio = scale[:, 2] / small.abs().amax(-1)
    assert torch.all((ratio > 2 ** (-1 / 64) - 1e-6) & (ratio < 2 ** (1 / 64) + 1e-6))
    assert rel_err(small_y, small) < 0.1


def int4_requantize(codes, scale_codes, bases, factors, midpoints, x):
    """Quantize ``x`` into int4 state and decode it again (what each update does)."""
    from muon_plugin.lp_state import int4_dequantize, int4_quantize_

    int4_quantize_(codes, scale_codes, bases, factors, midpoints, x)
    return int4_dequantize(codes, scale_codes, bases, factors)


def test_int4_compiled_requantization_is_bit_for_bit():
    """Compiled int4 quantization and decoding (the scale-code search, the table lookups, the
    element codes) give the same state and values as eager, bit for bit, on data that covers
    every scale code, all-zero blocks, tiny blocks and absmaxes on the code boundaries."""
    from muon_plugin.lp_state import compiled_update

    fmt = StateFormat("int4", 16)
    x = graded_blocks(256, 256, 16, octaves=9.0, seed=2)
    x[7] = 0.0
    x[9, :16] = 0.0
    x[11, 16:32] *= 1e-6
    x = torch.cat([x, boundary_blocks()])  # on the boundaries in the first step
    rows = x.shape[0]
    _, state = int4_roundtrip(x, 16)
    eager = tuple(fmt.view(state))
    compiled = tuple(t.clone() for t in eager[:3]) + eager[3:]
    for step in range(3):
        y = int4_requantize(*eager, x.view(-1))
        assert torch.equal(compiled_update(int4_requantize)(*compiled, x.view(-1)), y), step
        for a, b in zip(eager[:3], compiled[:3], strict=True):
            assert torch.equal(a, b), step
        grad = graded_blocks(rows, 256, 16, octaves=9.0, seed=10 + step)
        x = y.lerp(grad.view(-1), 0.05)
    assert len(eager[1].unique()) > 200


def legacy_int4_state(m: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """``m`` in the Lloyd-Max int4 format of earlier versions (fp32 RMS scales)."""
    from muon_plugin.lp_state import INT4_LEVEL_MAX, LEGACY_INT4_LEVELS

    levels = torch.tensor(LEGACY_INT4_LEVELS)
    blocks = m.reshape(-1, block_size)
    scale = blocks.square().mean(-1).sqrt() * INT4_LEVEL_MAX
    codes = ((blocks / scale.unsqueeze(-1)).unsqueeze(-1) - levels).abs().argmin(-1)
    codes = codes.view(-1).to(torch.uint8)
    packed = ((codes[::2] << 4) | codes[1::2]).view(*m.shape[:-1], -1)
    decoded = (levels[codes.long()].view_as(blocks) * scale.unsqueeze(-1)).view_as(m)
    return {CODES_KEY: packed, SCALES_KEY: scale.view(*m.shape[:-1], -1)}, decoded


def absmax_int4_state(m: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """``m`` in the previous int4 format (mid-rise codes, bf16 absmax rounded up per block)."""
    blocks = m.reshape(-1, block_size)
    scale = bf16_up(blocks.abs().amax(-1)).float()
    inv = scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    codes = (blocks / inv * 8).floor().add(8).clamp(0, 15).view(-1).to(torch.uint8)
    packed = ((codes[::2] << 4) | codes[1::2]).view(*m.shape[:-1], -1)
    decoded = ((codes.float() - 7.5).view_as(blocks) / 8 * scale.unsqueeze(-1)).view_as(m)
    scales = scale.to(torch.bfloat16).view(*m.shape[:-1], -1)
    return {CODES_KEY: packed, ABSMAX_KEY: scales}, decoded


@pytest.mark.parametrize(
    ("encode", "block_size"), [(legacy_int4_state, 128), (absmax_int4_state, 32)]
)
def test_legacy_int4_checkpoint_converts_on_load(encode, block_size):
    """A state dict of an earlier int4 format (Lloyd-Max codes with fp32 momentum_scales, or
    mid-rise codes with bf16 momentum_scales_bf16) is decoded with its own map and requantized
    into the current int4 format."""
    model = mlp()
    src = MuonForeach(groups(model), **KWARGS)
    random_grads(list(model.parameters()), 0)
    src.step()
    saved = copy.deepcopy(src.state_dict())
    mats = [p for p in model.parameters() if p.ndim == 2]
    decoded = {}
    for i in range(len(mats)):
        entry = saved["state"][i]
        legacy, decoded[i] = encode(entry.pop("momentum_buffer"), block_size)
        entry.update(legacy)
    dst = MuonLP(groups(copy.deepcopy(model)), state_dtype="int4", **KWARGS)
    dst.load_state_dict(saved)
    for i, q in enumerate(muon_params(dst)):
        assert set(dst.state[q]) == {CODES_KEY, SCALE_CODES_KEY, BASES_KEY}
        expected, _ = int4_roundtrip(decoded[i], 16)
        assert torch.equal(dst.momentum(q), expected)
        # The decoded legacy momentum is close to the fp32 momentum it was made from.
        assert rel_err(decoded[i], src.state[mats[i]]["momentum_buffer"]) < 0.15


def test_detect_format_reads_every_format_and_rejects_others():
    from muon_plugin.lp_state import ABSMAX_INT4, LLOYD_MAX_INT4, detect_format

    p = torch.zeros(64, 512)
    m = torch.randn(64, 512)
    formats = [StateFormat(k, b) for k, b in [("int4", 16), ("int4", 8), ("int8", 128)]]
    formats += [StateFormat("fp8", 256), StateFormat(PLAIN_FP8, 256)]
    for fmt in formats:
        assert detect_format(p, zero_state(fmt, tuple(p.shape))) == fmt
    assert detect_format(p, legacy_int4_state(m, 128)[0]) == StateFormat(LLOYD_MAX_INT4, 128)
    assert detect_format(p, absmax_int4_state(m, 32)[0]) == StateFormat(ABSMAX_INT4, 32)
    bad = int4_roundtrip(m, 16)[1]
    bad[BASES_KEY] = bad[BASES_KEY].float()
    with pytest.raises(ValueError, match="cannot read saved momentum"):
        detect_format(p, bad)


# ---------------------------------------------------------------------- fp8's rank-1 part


def test_fp8_state_layout_and_rank1_part():
    """fp8 = e4m3 codes + fp32 scales + bf16 u (rows) and w (columns); with gradients that share
    a direction, u w^T carries it and the fp8 residual is much smaller than the momentum."""
    assert StateFormat("fp8", 256).layout((3, 64, 512)) == {
        CODES_KEY: ((3, 64, 512), torch.float8_e4m3fn),
        SCALES_KEY: ((3, 64, 2), torch.float32),
        U_KEY: ((3, 64), torch.bfloat16),
        W_KEY: ((3, 512), torch.bfloat16),
    }
    model = mlp()
    opt = MuonLP(groups(model), state_dtype="fp8", **KWARGS)
    mats = muon_params(opt)
    gen = torch.Generator().manual_seed(7)
    shared = [
        (torch.randn(p.shape[0], 1, generator=gen), torch.randn(1, p.shape[1], generator=gen))
        for p in mats
    ]
    for _ in range(6):
        for p, (a, b) in zip(mats, shared, strict=True):
            p.grad = 3.0 * a * b + torch.randn(p.shape, generator=gen)
        opt.step()
    for p in mats:
        state = opt.state[p]
        u, w = state[U_KEY].float(), state[W_KEY].float()
        assert u.norm().item() == pytest.approx(1.0, rel=1e-2)
        m = opt.momentum(p)
        residual = m - u[:, None] * w[None, :]
        assert residual.abs().amax() < 0.5 * m.abs().amax()
        # momentum() = decoded codes + u w^T, the momentum the next step starts from.
        codes = state[CODES_KEY].float().view(m.shape[0], -1, 256)
        decoded = (codes * state[SCALES_KEY].view(m.shape[0], -1, 1)).view(m.shape)
        assert torch.allclose(decoded + u[:, None] * w[None, :], m)


def test_plain_fp8_checkpoint_converts_on_load():
    """fp8 state of the previous version (e4m3 codes and scales, no rank-1 part) loads exactly:
    its decoded momentum goes into the codes with u = 0, and the next step finds u and w."""
    model = mlp()
    src = MuonForeach(groups(model), **KWARGS)
    random_grads(list(model.parameters()), 0)
    src.step()
    saved = copy.deepcopy(src.state_dict())
    plain = StateFormat(PLAIN_FP8, 256)
    mats = [p for p in model.parameters() if p.ndim == 2]
    decoded = {}
    for i, p in enumerate(mats):
        entry = saved["state"][i]
        state = zero_state(plain, tuple(p.shape))
        plain.write(state, entry.pop("momentum_buffer"))
        decoded[i] = plain.read(state, tuple(p.shape))
        entry.update(state)
    dst = MuonLP(groups(copy.deepcopy(model)), state_dtype="fp8", **KWARGS)
    dst.load_state_dict(saved)
    for i, q in enumerate(muon_params(dst)):
        assert set(dst.state[q]) == {CODES_KEY, SCALES_KEY, U_KEY, W_KEY}
        assert torch.equal(dst.momentum(q), decoded[i])
        assert not dst.state[q][U_KEY].any()
    random_grads(muon_params(dst), 1)
    dst.step()
    assert all(dst.state[q][U_KEY].float().norm() > 0.5 for q in muon_params(dst))
