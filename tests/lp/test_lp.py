"""MuonLP: low-precision Muon momentum (bf16, int8, int4, fp8) that trains, shards and checkpoints.

Single-process tests train a small MLP, compare against fp32-state ``MuonForeach``, round-trip
state dicts and convert between formats. Sharding and DCP are tested in
``test_lp_distributed.py``, each format's own encoding in ``test_lp_<format>.py``, the stacked
momentum update in ``test_lp_momentum.py``.
"""

from __future__ import annotations

import copy
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lp_support import (
    DTYPES,
    KWARGS,
    groups,
    mlp,
    muon_params,
    random_grads,
    rel_err,
)
from subprocess_env import python_env
from torch import nn

from muon_plugin import MuonForeach
from muon_plugin.lp import Int4Codec, MuonLP
from muon_plugin.lp.keys import BASES_KEY, CODES_KEY, SCALE_CODES_KEY, SCALES_KEY

torchao = pytest.importorskip("torchao")

REPO = Path(__file__).resolve().parents[2]

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


# ---------------------------------------------------------------------- shared functions


def data(n: int = 512):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 256, generator=gen)
    w = torch.randn(256, 16, generator=gen) / 16
    return x, torch.tanh(x @ w)


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
    """compile=True compiles the state update too: the same codes, the same momentum, for each
    format that has codes (the FSDP2 tests run eager: what compile traces on a rank is that
    rank's plain local tensors, as here)."""
    for state_dtype in ("int8", "int4", "fp8"):
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
                elif state_dtype == "fp8":  # e4m3 codes and rank-1 factors, up to rounding
                    assert rel_err(other.float(), value.float()) < 1e-2, key
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
    """int8 / fp8 need torchao; int4 and bf16 are plain torch
    (tests/support/lp_without_torchao.py)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "lp_without_torchao.py")],
        env=python_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_int4_default_block_size():
    """Default int4 block: 16 elements, an 8-bit scale code each, a bf16 base per 256 elements."""
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
    assert opt8.state_format(params[1]) == Int4Codec(8)
