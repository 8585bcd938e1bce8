"""NorMuon (arXiv:2510.05491): the row normalization against an fp64 reference written from the
paper's equations, on 2-D matrices (wide, tall), 3-D expert stacks, fused QKV (row blocks) and
flattened parameters, from a zero state (the first step) and from a loaded one (a resume); the
optimizer's state, its checkpoints and its settings.

The reference takes the orthogonalized matrix ``ortho`` the optimizer itself computes (bf16, scaled
by the lr shape factor ``s`` of its row block: the same iteration, which the orthogonalization
tests check against SVD) and applies, in fp64, per matrix::

    Ou = ortho / s;  q_r = mean_c Ou_rc^2;  v_r = beta2 v_r + (1 - beta2) q_r
    ortho^ = Ou / (sqrt(v) + eps)                      (row r divided by its root)
    U  = s * c * ortho^ / ||ortho^||_F  per row block,     c = ||Ou||_F ("frobenius") or
                                                   sqrt(min(rows, cols)) ("rms", the paper's)

and ``p <- p - lr * U``. The stage returns each row's factor ``U_r / O_r`` (fp32), which the
update step multiplies in (in fp32), so the update matches the reference to fp32 rounding.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from muon_plugin import Muon, MuonForeach
from muon_plugin.functional import momentum_update_
from muon_plugin.learning_rate import LrShapeRule
from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack
from muon_plugin.orthogonalize.normuon import normuon_factors_, scale_rows
from muon_plugin.orthogonalize.spec import RowNormalization
from muon_plugin.row_state import ROW_STATE_KEY

FP32_REL = 1e-5
BETA2, EPS, MOMENTUM = 0.9, 1e-8, 0.9

# name -> (shape, group settings)
CASES = {
    "wide": ((8, 20), {}),
    "tall": ((20, 8), {}),
    "experts": ((3, 8, 12), {}),  # per expert matrix: rows are dim -2 of each
    "fused_qkv": ((24, 16), {"split_sizes": (16, 4, 4)}),  # GQA-like q, k, v blocks
    "conv": ((6, 3, 4), {"flatten": True}),  # one (6, 12) matrix, rows = dim 0
}


def reference_normuon(
    ortho: torch.Tensor, v: torch.Tensor, spec: MatrixSpec, beta2: float, eps: float, rescale: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's equations in fp64 on one parameter's orthogonalized update ``ortho`` (its
    shape) with its per-row state ``v``: returns ``(U, new v)``."""
    batch, m, n = spec.matrix_view(tuple(ortho.shape))
    X = ortho.double().reshape(batch, m, n)
    V = v.double().reshape(batch, m).clone()
    U = torch.empty_like(X)
    for b in range(batch):
        start = 0
        scales = torch.empty(m, dtype=torch.float64)
        for size in spec.split_sizes or (m,):
            scales[start : start + size] = spec.output_scale(size, n)
            start += size
        Ou = X[b] / scales[:, None]
        q = Ou.square().mean(dim=1)
        V[b] = beta2 * V[b] + (1 - beta2) * q
        hat = Ou / (V[b].sqrt() + eps)[:, None]
        start = 0
        for size in spec.split_sizes or (m,):
            rows = slice(start, start + size)
            c = Ou[rows].norm() if rescale == "frobenius" else math.sqrt(min(size, n))
            U[b, rows] = scales[rows, None] * c * hat[rows] / hat[rows].norm()
            start += size
    return U.reshape(ortho.shape), V.reshape(v.shape)


def assert_update_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Elementwise within fp32 rounding of the reference (and of the weights it lands in)."""
    tol = FP32_REL * ref.abs() + 1e-6 * ref.abs().max()
    bad = (got.double() - ref).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max {(got - ref).abs().max()}"


def grads_for(shape, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


# ---------------------------------------------------------------------- the stage alone


@pytest.mark.parametrize("rescale", ["frobenius", "rms"])
@pytest.mark.parametrize("lr_adjust", ["match_rms_adamw", "keller"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_normuon_stage_matches_the_paper_equations(case, lr_adjust, rescale):
    shape, settings = CASES[case]
    norm = RowNormalization(beta2=BETA2, eps=EPS, rescale=rescale)
    spec = MatrixSpec(output_scale=LrShapeRule(lr_adjust), normalization=norm, **settings)
    gen = torch.Generator().manual_seed(1)
    # Two parameters of one stack; rows of very different sizes, so the division matters.
    G = torch.randn((2, *shape), generator=gen) * torch.rand((2, *shape[:-1], 1), generator=gen)
    plain = MatrixSpec(output_scale=LrShapeRule(lr_adjust), **settings)
    ortho = orthogonalize_stack(G, plain)  # what the plan hands the stage (bf16)
    rows = spec.row_shape(shape)
    for state in ("zero", "loaded"):
        v = torch.zeros((2, *rows)) if state == "zero" else torch.rand((2, *rows), generator=gen)
        v_in = v.clone()
        f = normuon_factors_(ortho, v, spec)
        assert f.dtype == torch.float32 and f.shape == v.shape
        U = scale_rows(ortho, f)
        for k in range(2):
            ref_U, ref_v = reference_normuon(ortho[k], v_in[k], spec, BETA2, EPS, rescale)
            torch.testing.assert_close(v[k].double(), ref_v, rtol=1e-5, atol=0)
            assert_update_close(U[k], ref_U, f"{case} {state} #{k}")


def test_rows_are_dim_minus_two_as_stored():
    """A matrix and its transpose are different NorMuon problems: the rows of a (m, n)
    parameter are its m output features, whatever the layout the model uses it in."""
    keller = LrShapeRule("keller")
    spec = MatrixSpec(output_scale=keller, normalization=RowNormalization(0.95, 1e-8, "frobenius"))
    gen = torch.Generator().manual_seed(2)
    G = torch.randn(1, 12, 30, generator=gen) * torch.rand(1, 12, 1, generator=gen)
    ortho = orthogonalize_stack(G, MatrixSpec(output_scale=keller))
    Ot = orthogonalize_stack(G.mT.contiguous(), MatrixSpec(output_scale=keller))
    U = scale_rows(ortho, normuon_factors_(ortho, torch.zeros(1, 12), spec))
    Ut = scale_rows(Ot, normuon_factors_(Ot, torch.zeros(1, 30), spec))
    ref, _ = reference_normuon(ortho[0], torch.zeros(12), spec, 0.95, 1e-8, "frobenius")
    assert_update_close(U[0], ref, "rows")
    assert (Ut[0].mT - U[0]).abs().max() > 0.05  # columns normalized instead


def test_the_row_rescale_is_per_block_not_per_matrix():
    """Fused QKV: each projection block is rescaled on its own (its own lr factor and norm);
    one rescale over the whole fused matrix gives another update."""
    norm = RowNormalization(0.95, 1e-8, "rms")
    rule = LrShapeRule("match_rms_adamw")
    split = MatrixSpec(split_sizes=(16, 4, 4), normalization=norm, output_scale=rule)
    G = torch.randn(1, 24, 16, generator=torch.Generator().manual_seed(3))
    ortho = orthogonalize_stack(G, MatrixSpec(split_sizes=(16, 4, 4), output_scale=rule))
    U = scale_rows(ortho, normuon_factors_(ortho, torch.zeros(1, 24), split))
    for rows in (slice(0, 16), slice(16, 20), slice(20, 24)):
        rms = U[0, rows].square().mean().sqrt().item()
        # "rms" with match_rms_adamw: 0.2 * sqrt(max) * sqrt(min) / sqrt(size * cols) = 0.2
        assert rms == pytest.approx(0.2, rel=1e-5), (rows, rms)


def test_zero_matrix_gets_a_zero_update_and_nan_stays_nan():
    spec = MatrixSpec(normalization=RowNormalization(0.95, 1e-8, "rms"))
    ortho = torch.zeros(2, 6, 10, dtype=torch.bfloat16)
    ortho[1, 0, 0] = float("nan")
    v = torch.zeros(2, 6)
    f = normuon_factors_(ortho, v, spec)
    assert torch.equal(f[0], torch.zeros(6)) and torch.equal(v[0], torch.zeros(6))
    assert f[1].isnan().all()


def test_the_factors_do_not_depend_on_the_stack():
    """A matrix's factors are its own: alone or in a stack of others, bit for bit."""
    spec = MatrixSpec(normalization=RowNormalization(0.9, 1e-8, "frobenius"))
    ortho = orthogonalize_stack(
        torch.randn(5, 7, 33, generator=torch.Generator().manual_seed(12)), MatrixSpec()
    )
    together = normuon_factors_(ortho, torch.zeros(5, 7), spec)
    for k in range(5):
        alone = normuon_factors_(ortho[k : k + 1].clone(), torch.zeros(1, 7), spec)
        assert torch.equal(alone[0], together[k])


# ---------------------------------------------------------------------- the optimizer


def run_against_reference(driver, case, lr_adjust, rescale, steps=3, loaded=None):
    """``steps`` NorMuon steps from zero weights with lr 1 (so each step's update is exact in
    the weights' difference) against the reference, fed the optimizer's own ``ortho``."""
    shape, settings = CASES[case]
    p = torch.nn.Parameter(torch.zeros(shape))
    group = {"params": [p], "param_names": [case], **settings}
    kwargs = dict(lr=1.0, wd=0.0, momentum=MOMENTUM, lr_adjust=lr_adjust)
    norm = dict(normalization="normuon", normuon_beta2=BETA2, normuon_eps=EPS)
    opt = driver([group], **kwargs, **norm, normuon_rescale=rescale)
    spec = MatrixSpec(output_scale=LrShapeRule(lr_adjust), **settings)
    rows = spec.row_shape(shape)
    v = torch.zeros(rows, dtype=torch.float64)
    if loaded is not None:  # a resumed state: momentum and second moment from a checkpoint
        state = {"momentum_buffer": loaded[0], ROW_STATE_KEY: loaded[1]}
        opt.load_state_dict({"state": {0: state}, "param_groups": opt.state_dict()["param_groups"]})
        v = loaded[1].double()
    buf = torch.zeros(shape) if loaded is None else loaded[0].clone()
    for t, g in enumerate(grads_for(shape, steps)):
        (direction,) = momentum_update_([g], [buf], MOMENTUM, True)
        ortho = orthogonalize_stack(direction[None], spec)[0]
        ref_U, v = reference_normuon(ortho, v, spec, BETA2, EPS, rescale)
        before = p.detach().clone()
        p.grad = g
        opt.step()
        got = before - p.detach()
        assert_update_close(got, ref_U, f"{driver.__name__} {case} step {t}")
        state = opt.state[p][ROW_STATE_KEY]
        assert state.dtype == torch.float32 and tuple(state.shape) == rows
        torch.testing.assert_close(state.double(), v, rtol=1e-5, atol=0)
    return opt


@pytest.mark.parametrize("rescale", ["frobenius", "rms"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_steps_match_the_reference(case, rescale):
    run_against_reference(MuonForeach, case, "match_rms_adamw", rescale)


@pytest.mark.parametrize("case", ["wide", "experts", "fused_qkv"])
def test_per_param_driver_matches_the_reference(case):
    run_against_reference(Muon, case, "keller", "frobenius", steps=2)


@pytest.mark.parametrize("case", ["tall", "experts", "fused_qkv"])
def test_a_resumed_state_continues_the_reference(case):
    shape, settings = CASES[case]
    rows = MatrixSpec(**settings).row_shape(shape)
    gen = torch.Generator().manual_seed(9)
    loaded = (torch.randn(shape, generator=gen), torch.rand(rows, generator=gen) * 0.1)
    run_against_reference(MuonForeach, case, "match_rms_adamw", "rms", steps=2, loaded=loaded)


def test_muon_and_muon_foreach_agree_bitwise():
    shapes = {"a": (8, 12), "b": (8, 12), "c": (3, 6, 10), "qkv": (24, 16)}
    results = []
    for driver in (Muon, MuonForeach):
        gen = torch.Generator().manual_seed(4)
        params = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}
        groups = [
            {"params": [params[n] for n in ("a", "b", "c")]},
            {"params": [params["qkv"]], "split_sizes": (16, 4, 4)},
        ]
        opt = driver(groups, lr=0.05, normalization="normuon")
        for _ in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results.append({n: p.detach().clone() for n, p in params.items()})
    for n in shapes:
        assert torch.equal(results[0][n], results[1][n]), n


def test_normuon_differs_from_muon_and_is_off_by_default():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(16, 24, generator=gen)
    grads = [
        torch.randn(16, 24, generator=gen) * torch.rand(16, 1, generator=gen) for _ in range(2)
    ]
    out = {}
    for setting in (None, "none", "normuon"):
        p = torch.nn.Parameter(base.clone())
        opt = MuonForeach([p], lr=0.02, **({} if setting is None else {"normalization": setting}))
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[setting] = p.detach()
        assert (ROW_STATE_KEY in opt.state[p]) == (setting == "normuon")
    assert torch.equal(out[None], out["none"])
    assert not torch.allclose(out["none"], out["normuon"], atol=1e-4)


def test_per_group_settings():
    a, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
    opt = MuonForeach(
        [{"params": [a]}, {"params": [b], "normalization": "normuon", "normuon_beta2": 0.5}],
        lr=0.01,
    )
    for p in (a, b):
        p.grad = torch.randn(8, 8)
    opt.step()
    assert ROW_STATE_KEY not in opt.state[a] and ROW_STATE_KEY in opt.state[b]
    assert opt.param_groups[1]["normuon_beta2"] == 0.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"normalization": "nor"}, r"normalization 'nor'"),
        ({"normalization": "normuon", "normuon_beta2": 1.0}, r"normuon_beta2 must be"),
        ({"normuon_eps": -1.0}, r"normuon_eps must be a number >= 0"),
        ({"normuon_rescale": "paper"}, r"normuon_rescale 'paper'"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MuonForeach([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)
    with pytest.raises(ValueError, match=match):
        MuonForeach([{"params": [torch.nn.Parameter(torch.randn(4, 4))], **kwargs}])


# ---------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_keeps_fp32_second_moments_of_bf16_params():
    def make():
        gen = torch.Generator().manual_seed(6)
        p = torch.nn.Parameter(torch.randn(3, 8, 16, generator=gen).bfloat16())
        return p, MuonForeach([("experts.w1", p)], lr=0.02, normalization="normuon")

    p, opt = make()
    grads = grads_for((3, 8, 16), 4, seed=7)
    for g in grads[:2]:
        p.grad = g.bfloat16()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # a checkpoint: not the live tensors
    q, resumed = make()
    q.data.copy_(p.data)
    resumed.load_state_dict(saved)
    state = resumed.state[q][ROW_STATE_KEY]
    assert state.dtype == torch.float32 and torch.equal(state, opt.state[p][ROW_STATE_KEY])
    for g in grads[2:]:
        p.grad, q.grad = g.bfloat16(), g.bfloat16()
        opt.step()
        resumed.step()
    assert torch.equal(p, q)


def test_loading_a_second_moment_of_the_wrong_shape_names_the_parameter():
    p = torch.nn.Parameter(torch.randn(8, 16))
    opt = MuonForeach([("layers.0.wq.weight", p)], normalization="normuon")
    bad = {
        "state": {0: {ROW_STATE_KEY: torch.zeros(16)}},
        "param_groups": opt.state_dict()["param_groups"],
    }
    with pytest.raises(ValueError, match=r"layers\.0\.wq\.weight.*normuon_second_moment.*\(8,\)"):
        opt.load_state_dict(bad)


def test_a_state_replaced_after_a_step_is_checked_again():
    """The step skips checking a state it checked before: one replaced by hand is checked (a
    wrong one refused by name) and used."""
    p = torch.nn.Parameter(torch.randn(8, 16))
    p.grad = torch.randn(8, 16)
    opt = MuonForeach([("layers.0.wq.weight", p)], normalization="normuon")
    opt.step()
    opt.state[p][ROW_STATE_KEY] = torch.zeros(16)
    with pytest.raises(ValueError, match=r"layers\.0\.wq\.weight.*normuon_second_moment"):
        opt.step()
    fresh = torch.full((8,), 7.0)
    opt.state[p][ROW_STATE_KEY] = fresh
    opt.step()
    assert opt.state[p][ROW_STATE_KEY] is fresh and not torch.equal(fresh, torch.full((8,), 7.0))


def test_a_muon_checkpoint_starts_normuon_from_a_zero_second_moment():
    """Switching a run from Muon to NorMuon: the momentum is kept, the second moment starts at
    zero, as in a fresh NorMuon run. Group settings come from the checkpoint (torch.optim's
    rule), so the loaded group says "none" until it is set again."""
    gen = torch.Generator().manual_seed(8)
    init = torch.randn(8, 16, generator=gen)
    grads = [torch.randn(8, 16, generator=gen) for _ in range(2)]
    p = torch.nn.Parameter(init.clone())
    muon = MuonForeach([("w", p)], lr=0.02)
    p.grad = grads[0]
    muon.step()
    switched = MuonForeach([("w", p)], lr=0.02, normalization="normuon")
    switched.load_state_dict(muon.state_dict())
    assert switched.param_groups[0]["normalization"] == "none"
    switched.param_groups[0]["normalization"] = "normuon"
    assert ROW_STATE_KEY not in switched.state[p]
    q = torch.nn.Parameter(p.detach().clone())
    fresh = MuonForeach([("w", q)], lr=0.02, normalization="normuon")
    fresh.state[q]["momentum_buffer"] = muon.state[p]["momentum_buffer"].clone()
    p.grad, q.grad = grads[1], grads[1].clone()
    switched.step()
    fresh.step()
    assert torch.equal(p, q)
    assert torch.equal(switched.state[p][ROW_STATE_KEY], fresh.state[q][ROW_STATE_KEY])


# ---------------------------------------------------------------------- the plan report


def test_plan_report_counts_the_second_moments_bytes():
    """fp32 per-row state: 4 bytes a row on every rank holding part of the row; its traffic
    is part of the group's (from row shards to the owner and back; from a column-sharded
    matrix's owner, which holds every row, back to the other ranks' copies)."""
    from torch.distributed.tensor import Shard

    from muon_plugin.distributed.plan import simulate_plan
    from muon_plugin.distributed.report import format_report

    norm = MatrixSpec(normalization=RowNormalization(0.95, 1e-8, "frobenius"))
    plain = MatrixSpec()
    entries = [
        ((32, 16), (4,), (Shard(0),), norm),
        ((32, 16), (4,), (Shard(1),), norm),
        ((32, 16), (4,), (Shard(0),), plain),
    ]
    rows = simulate_plan(entries).report()
    rows_fsdp, rows_tp, rows_plain = rows
    assert rows_fsdp["normalization"] == "normuon" and rows_plain["normalization"] == "none"
    assert rows_fsdp["row_state_bytes_per_rank"] == [8 * 4] * 4
    assert rows_tp["row_state_bytes_per_rank"] == [32 * 4] * 4
    # to the owner, and back with the rows' factors
    assert sum(rows_fsdp["row_send_bytes_per_rank"]) == 3 * 3 * 8 * 4
    assert sum(rows_tp["row_send_bytes_per_rank"]) == 2 * 3 * 32 * 4  # back to the copies
    assert rows_plain["row_state_bytes_per_rank"] == [0] * 4
    # The sent bytes include the rows' (a matrix of the same shape without them: less).
    extra = sum(rows_fsdp["send_bytes_per_rank"]) - sum(rows_plain["send_bytes_per_rank"])
    assert extra == sum(rows_fsdp["row_send_bytes_per_rank"])
    text = format_report(rows)
    assert "+ normuon" in text and "normuon second moments: 2 group(s)" in text, text


# ---------------------------------------------------------------------- with other features


@pytest.mark.parametrize("state_dtype", ["bf16", "int4"])
def test_muonlp_keeps_the_second_moments_in_fp32(state_dtype):
    """MuonLP quantizes the momentum only; NorMuon's second moments (m floats a matrix) stay
    fp32. The first step (exact momentum) is MuonForeach's, second moments included."""
    from muon_plugin import MuonLP

    shape = (2, 32, 256)  # int4 blocks need a last dim that is a multiple of 256
    gen = torch.Generator().manual_seed(10)
    init, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ps = [torch.nn.Parameter(init.clone()) for _ in range(2)]
    kw = dict(lr=0.02, normalization="normuon")
    lp = MuonLP([("experts", ps[0])], state_dtype=state_dtype, **kw)
    ref = MuonForeach([("experts", ps[1])], **kw)
    for p, opt in zip(ps, (lp, ref), strict=True):
        p.grad = g.clone()
        opt.step()
    assert torch.equal(ps[0], ps[1])
    assert torch.equal(lp.state[ps[0]][ROW_STATE_KEY], ref.state[ps[1]][ROW_STATE_KEY])
    saved = copy.deepcopy(lp.state_dict())
    again = MuonLP([("experts", ps[0])], state_dtype=state_dtype, **kw)
    again.load_state_dict(saved)
    state = again.state[ps[0]][ROW_STATE_KEY]
    assert state.dtype == torch.float32 and torch.equal(state, lp.state[ps[0]][ROW_STATE_KEY])


@pytest.mark.parametrize("driver", [Muon, MuonForeach])
def test_skip_nonfinite_keeps_the_second_moment_of_a_skipped_matrix(driver):
    gen = torch.Generator().manual_seed(11)
    ps = [torch.nn.Parameter(torch.randn(8, 12, generator=gen)) for _ in range(2)]
    opt = driver(ps, lr=0.02, normalization="normuon", skip_nonfinite=True)
    for p in ps:
        p.grad = torch.randn(8, 12, generator=gen)
    opt.step()
    before = [p.detach().clone() for p in ps]
    second = [opt.state[p][ROW_STATE_KEY].clone() for p in ps]
    for p in ps:
        p.grad = torch.randn(8, 12, generator=gen)
    ps[0].grad[3, 4] = float("nan")
    opt.step()
    assert opt.skipped_updates == 1
    assert torch.equal(ps[0], before[0]) and not torch.equal(ps[1], before[1])
    assert torch.equal(opt.state[ps[0]][ROW_STATE_KEY], second[0])
    assert not torch.equal(opt.state[ps[1]][ROW_STATE_KEY], second[1])
