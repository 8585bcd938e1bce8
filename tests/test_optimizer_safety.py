"""No silent wrong results: loading by name, copies, Tensor lr, torch.optim's names, complex
AdamW parameters, non-finite and huge gradients (CPU, one process)."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch

from muon_plugin import Muon, MuonForeach
from muon_plugin.orthogonalize import MatrixSpec, orthogonalize_stack, zeropower

DRIVERS = [Muon, MuonForeach]


def make_params(*shapes, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype) * 0.02) for s in shapes]


def set_grads(params, step: int, seed: int = 100):
    g = torch.Generator().manual_seed(seed + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def lp_or_skip():
    pytest.importorskip("torchao")
    from muon_plugin.lp import MuonLP

    return MuonLP


# ---------------------------------------------------------------------- load_state_dict


def named_groups(params, names, order):
    return [
        {"params": [params[i] for i in order], "param_names": [names[i] for i in order]},
    ]


@pytest.mark.parametrize("driver", DRIVERS)
def test_load_state_dict_matches_by_name(driver):
    """Same-shape parameters in another order receive their own momentum, not their slot's."""
    names = ["a", "b", "c"]
    params = make_params((16, 8), (16, 8), (16, 8))
    opt = driver(named_groups(params, names, [0, 1, 2]), lr=0.01)
    set_grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = clone_params(params)
    other = driver(named_groups(fresh, names, [2, 0, 1]), lr=0.01)
    other.load_state_dict(saved)
    for p, q in zip(params, fresh, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], other.state[q]["momentum_buffer"])
    # And both then step identically.
    set_grads(params, 1)
    for p, q in zip(params, fresh, strict=True):
        q.grad = p.grad.clone()
    opt.step()
    other.step()
    for p, q in zip(params, fresh, strict=True):
        assert torch.equal(p, q)


def test_load_state_dict_without_names_is_by_position():
    params = make_params((16, 8), (16, 8))
    opt = Muon(params, lr=0.01)
    set_grads(params, 0)
    opt.step()
    fresh = clone_params(params)
    other = Muon([fresh[1], fresh[0]], lr=0.01)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(
        other.state[fresh[1]]["momentum_buffer"], opt.state[params[0]]["momentum_buffer"]
    )


def test_load_state_dict_names_on_one_side_only_raise():
    params = make_params((16, 8), (16, 8))
    opt = Muon(named_groups(params, ["a", "b"], [0, 1]))
    set_grads(params, 0)
    opt.step()
    saved = opt.state_dict()
    fresh = clone_params(params)
    with pytest.raises(ValueError, match="has no parameter 'c'"):
        Muon(named_groups(fresh, ["a", "c"], [0, 1])).load_state_dict(copy.deepcopy(saved))
    renamed = copy.deepcopy(saved)
    renamed["param_groups"][0]["param_names"] = ["a", "z"]
    with pytest.raises(ValueError, match="has no parameter 'b'"):
        Muon(named_groups(fresh, ["a", "b"], [0, 1])).load_state_dict(renamed)


def test_load_state_dict_drops_no_saved_parameter_silently():
    params = make_params((16, 8), (16, 8), (16, 8))
    opt = Muon([{"params": params, "param_names": ["a", "b", "c"]}])
    set_grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["params"] = [0, 1, 2]
    fresh = clone_params(params)
    live = Muon([{"params": fresh[:2] + [fresh[2]], "param_names": ["a", "b", "d"]}])
    with pytest.raises(ValueError, match="'d'"):
        live.load_state_dict(saved)


@pytest.mark.parametrize("driver", DRIVERS)
def test_load_state_dict_checks_shapes_and_dtypes_naming_the_parameter(driver):
    params = make_params((16, 8), (8,))
    groups = [
        {"params": params[:1], "param_names": ["w"]},
        {"params": params[1:], "param_names": ["b"], "algorithm": "adamw"},
    ]
    opt = driver(groups)
    set_grads(params, 0)
    opt.step()
    saved = opt.state_dict()

    def load(mutate):
        sd = copy.deepcopy(saved)
        mutate(sd["state"])
        fresh = clone_params(params)
        other = driver(
            [
                {"params": fresh[:1], "param_names": ["w"]},
                {"params": fresh[1:], "param_names": ["b"], "algorithm": "adamw"},
            ]
        )
        other.load_state_dict(sd)

    def wrong_shape(st):
        st[0]["momentum_buffer"] = torch.zeros(8, 16)

    def wrong_dtype(st):
        st[0]["momentum_buffer"] = torch.zeros(16, 8, dtype=torch.int32)

    def wrong_adam(st):
        st[1]["exp_avg"] = torch.zeros(9)

    with pytest.raises(ValueError, match=r"parameter 'w'.*'momentum_buffer' has shape \(8, 16\)"):
        load(wrong_shape)
    with pytest.raises(ValueError, match="parameter 'w'.*'momentum_buffer' has dtype torch.int32"):
        load(wrong_dtype)
    with pytest.raises(ValueError, match=r"parameter 'b'.*'exp_avg' has shape \(9,\)"):
        load(wrong_adam)
    load(lambda st: None)  # the unchanged state loads


def test_load_state_dict_keeps_fp32_momentum_when_matching_by_name():
    params = make_params((16, 8), (16, 8), dtype=torch.bfloat16)
    opt = Muon(named_groups(params, ["a", "b"], [0, 1]))
    set_grads(params, 0)
    opt.step()
    fresh = clone_params(params)
    other = Muon(named_groups(fresh, ["a", "b"], [1, 0]))
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, fresh, strict=True):
        assert other.state[q]["momentum_buffer"].dtype == torch.float32
        assert torch.equal(other.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])


# ---------------------------------------------------------------------- deepcopy and pickle


def round_trips():
    def deep(opt):
        return copy.deepcopy(opt)

    def pickled(opt):
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def plain_pickle(opt):
        return pickle.loads(pickle.dumps(opt))

    return [deep, pickled, plain_pickle]


def lp_driver(**kwargs):
    MuonLP = lp_or_skip()

    def build(groups, **kw):
        return MuonLP(groups, **kw, **kwargs)

    build.__name__ = "MuonLP"
    return build


COPY_CASES = [
    (kind, i)
    for kind in ("Muon", "MuonForeach", "MuonLP-int8", "MuonLP-int4")
    for i in range(3)
    if not (kind.startswith("MuonLP") and i == 2)  # plain pickle: once per non-LP kind
]


@pytest.mark.parametrize(("kind", "trip"), COPY_CASES)
def test_copies_step_like_the_original(kind, trip):
    round_trip = round_trips()[trip]
    if kind == "Muon":
        driver = Muon
    elif kind == "MuonForeach":
        driver = MuonForeach
    elif kind == "MuonLP-int8":
        driver = lp_driver(state_dtype="int8", block_size=64)
    else:
        driver = lp_driver(state_dtype="int4")
    params = make_params((64, 64), (16, 32), (64,))
    groups = [
        {"params": params[:2], "param_names": ["w1", "w2"]},
        {"params": params[2:], "param_names": ["b"], "algorithm": "adamw"},
    ]
    opt = driver(groups, lr=0.02, skip_nonfinite=True)
    set_grads(params, 0)
    opt.step()
    twin = round_trip(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert twin.skip_nonfinite and twin.skipped_updates == 0
    for name in ("state_dtype", "block_size"):
        if hasattr(opt, name):
            assert getattr(twin, name) == getattr(opt, name)
    for step in (1, 2):
        set_grads(params, step)
        for p, q in zip(params, twin_params, strict=True):
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params, strict=True):
        assert q is not p
        assert torch.equal(p, q)


def test_deepcopy_keeps_the_replicate_group_and_pickle_drops_it():
    def marker():  # stands in for a process group: neither picklable nor copyable here
        return None

    params = make_params((16, 8))
    opt = Muon(params)
    opt.replicate_group = marker
    assert copy.deepcopy(opt).replicate_group is marker
    twin = pickle.loads(pickle.dumps(opt))
    assert twin.replicate_group is None and opt.replicate_group is marker


# ---------------------------------------------------------------------- Tensor lr


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_one_element_tensor_lr_works_like_a_float(driver, shape):
    params = make_params((32, 16), (16,))
    twin = clone_params(params)

    def groups(ps):
        return [{"params": ps[:1]}, {"params": ps[1:], "algorithm": "adamw"}]

    a = driver(groups(params), lr=0.01)
    b = driver(groups(twin), lr=torch.full(shape, 0.01))
    for step in range(2):
        set_grads(params, step)
        set_grads(twin, step)
        a.step()
        b.step()
    for p, q in zip(params, twin, strict=True):
        assert torch.equal(p, q)


def test_two_element_tensor_lr_raises_value_error_naming_lr():
    with pytest.raises(ValueError, match=r"Tensor lr must be 1-element.*shape \(2,\)"):
        Muon(make_params((8, 4)), lr=torch.tensor([0.01, 0.02]))


# ---------------------------------------------------------------------- torch.optim names


def test_torch_names_are_synonyms_of_ours():
    params = make_params((8, 4))
    opt = Muon(params, weight_decay=0.2, adjust_lr_fn="match_rms_adamw", eps=1e-6)
    g = opt.param_groups[0]
    assert (g["wd"], g["lr_adjust"], g["ns_eps"]) == (0.2, "match_rms_adamw", 1e-6)
    assert "weight_decay" not in g and "adjust_lr_fn" not in g and "eps" not in g
    assert Muon(params, adjust_lr_fn="original").param_groups[0]["lr_adjust"] == "keller"
    assert Muon(params, adjust_lr_fn=None).param_groups[0]["lr_adjust"] == "keller"
    bias = make_params((4,))
    opt = Muon(
        [
            {"params": params, "weight_decay": 0.3, "adjust_lr_fn": "original", "eps": 1e-5},
            {"params": bias, "algorithm": "adamw", "eps": 1e-6, "betas": (0.8, 0.9)},
        ]
    )
    muon, adam = opt.param_groups
    assert (muon["wd"], muon["lr_adjust"], muon["ns_eps"]) == (0.3, "keller", 1e-5)
    assert (adam["adam_eps"], adam["adam_betas"]) == (1e-6, (0.8, 0.9))


def test_both_names_of_one_setting_raise_naming_both():
    params = make_params((8, 4))
    with pytest.raises(ValueError, match="both 'weight_decay' and 'wd'"):
        Muon(params, wd=0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="both 'adjust_lr_fn' and 'lr_adjust'"):
        Muon(params, lr_adjust="keller", adjust_lr_fn="original")
    with pytest.raises(ValueError, match="both 'eps' and 'ns_eps'"):
        Muon(params, ns_eps=1e-7, eps=1e-7)
    with pytest.raises(ValueError, match="param group 0: both 'weight_decay' and 'wd'"):
        Muon([{"params": params, "wd": 0.1, "weight_decay": 0.2}])
    with pytest.raises(ValueError, match="param group 0: both 'eps' and 'adam_eps'"):
        Muon([{"params": make_params((4,)), "algorithm": "adamw", "eps": 1e-6, "adam_eps": 1e-8}])
    with pytest.raises(ValueError, match="Adjust learning rate function arbitrary"):
        Muon(params, adjust_lr_fn="arbitrary")


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_torch_arguments_give_torch_optim_muon_numbers(driver, adjust):
    """torch.optim.Muon's arguments, ours plain decay: its update up to bf16 noise, exactly
    the same momentum; and the same numbers as our own names for the same settings."""
    shapes = [(64, 32), (32, 96)]
    ours = make_params(*shapes)
    theirs = clone_params(ours)
    mine = clone_params(ours)
    kwargs = dict(
        lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust, eps=1e-7, ns_coefficients=(3.4, -4.7, 2.0)
    )
    opt = driver(ours, use_cautious_wd=False, ns_steps=5, **kwargs)
    ref = torch.optim.Muon(theirs, ns_steps=5, **kwargs)
    same = driver(
        mine,
        lr=0.02,
        wd=0.1,
        lr_adjust="keller" if adjust == "original" else adjust,
        ns_eps=1e-7,
        ns_coefficients=(3.4, -4.7, 2.0),
        use_cautious_wd=False,
    )
    start = [p.detach().clone() for p in ours]
    for step in range(3):
        for ps in (ours, theirs, mine):
            set_grads(ps, step)
        opt.step()
        ref.step()
        same.step()
    for p, q, r, p0 in zip(ours, theirs, mine, start, strict=True):
        rel = ((p - q).double().norm() / (q - p0).double().norm()).item()
        assert rel < 3e-2
        assert torch.equal(p, r)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"], rtol=0, atol=0
        )


def test_ns_coefficients_are_validated():
    with pytest.raises(ValueError, match="ns_coefficients must be three finite numbers"):
        Muon(make_params((8, 4)), ns_coefficients=(1.0, 2.0))


# ---------------------------------------------------------------------- complex AdamW


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("driver", DRIVERS)
def test_complex_adamw_params_update_like_torch_adamw(driver, fused):
    g = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.complex64, generator=g))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt = driver(
        [{"params": [ours], "algorithm": "adamw"}],
        lr=0.01,
        wd=0.1,
        adam_betas=(0.9, 0.95),
        adam_eps=1e-8,
        fused_adam=fused,
    )
    ref = torch.optim.AdamW(
        [theirs], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=not fused
    )
    for _ in range(3):
        grad = torch.randn(6, 5, dtype=torch.complex64, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert ours.dtype == torch.complex64 and opt.state[ours]["exp_avg"].is_complex()


# ---------------------------------------------------------------------- non-finite updates


def nonfinite_grads(params, step, bad: dict[int, float]):
    set_grads(params, step)
    for k, value in bad.items():
        params[k].grad[1, 2] = value


SKIP_CASES = [(d, v) for d in DRIVERS for v in (math.nan, math.inf, -math.inf)] + [
    ("MuonLP-int8", math.nan),
    ("MuonLP-bf16", math.inf),
]


@pytest.mark.parametrize("phased", [False, True], ids=["one pass", "one phase per matrix"])
@pytest.mark.parametrize(("driver", "value"), SKIP_CASES)
def test_skip_nonfinite_keeps_weights_and_momentum_of_the_bad_matrix(
    driver, value, phased, monkeypatch
):
    if phased:  # each matrix a phase of its own (momentum -> update, one after another)
        for bound in ("MAX_LOCAL_GROUP_NUMEL", "MAX_PHASE_NUMEL"):
            monkeypatch.setattr(f"muon_plugin.distributed.planner.{bound}", 64 * 64)
    if driver == "MuonLP-int8":
        driver = lp_driver(state_dtype="int8", block_size=64)
    elif driver == "MuonLP-bf16":
        driver = lp_driver(state_dtype="bf16")
    params = make_params((64, 64), (64, 64), (16, 32))
    twin = clone_params(params)
    opt = driver(params, lr=0.02, skip_nonfinite=True)
    ref = driver(twin[:1] + twin[2:], lr=0.02)  # the same optimizer without the bad matrix
    set_grads(params, 0)
    for p, q in zip(params, twin, strict=True):
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    twin[1].data.copy_(params[1])
    before = params[1].detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[params[1]].items()}
    nonfinite_grads(params, 1, {1: value})
    for p, q in zip(params, twin, strict=True):
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert opt.skipped_updates == 1
    assert torch.equal(params[1], before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[params[1]][k], v), k
    for k in (0, 2):
        assert torch.equal(params[k], twin[k])
    # Training goes on: a finite gradient updates it again.
    set_grads(params, 2)
    opt.step()
    assert torch.isfinite(params[1]).all() and not torch.equal(params[1], before)
    assert opt.skipped_updates == 1


def test_without_skip_nonfinite_a_nan_poisons_the_matrix():
    params = make_params((16, 8))
    opt = Muon(params, lr=0.02)
    nonfinite_grads(params, 0, {0: math.nan})
    opt.step()
    assert not torch.isfinite(params[0]).any() and opt.skipped_updates == 0


def test_skip_nonfinite_first_step_keeps_zero_momentum():
    params = make_params((16, 8))
    opt = MuonForeach(params, lr=0.02, skip_nonfinite=True)
    before = params[0].detach().clone()
    nonfinite_grads(params, 0, {0: math.nan})
    opt.step()
    assert torch.equal(params[0], before)
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], torch.zeros(16, 8))


def test_skip_nonfinite_skips_only_the_bad_row_block_or_batch_matrix():
    """Split row blocks and batched matrices are orthogonalized one by one: only the bad one
    is skipped (the elementwise mask is exactly the non-finite matrices)."""
    fused = make_params((24, 16))
    experts = make_params((3, 16, 8))
    opt = MuonForeach(
        [{"params": fused, "split_sizes": (8, 8, 8)}, {"params": experts}],
        lr=0.02,
        skip_nonfinite=True,
    )
    f0, e0 = fused[0].detach().clone(), experts[0].detach().clone()
    set_grads(fused + experts, 0)
    fused[0].grad[9, 0] = math.nan  # row block 1
    experts[0].grad[2, 3, 1] = math.inf  # matrix 2
    opt.step()
    assert opt.skipped_updates == 2
    assert torch.equal(fused[0][8:16], f0[8:16]) and torch.equal(experts[0][2], e0[2])
    assert not torch.equal(fused[0][:8], f0[:8]) and not torch.equal(experts[0][0], e0[0])
    assert torch.isfinite(fused[0]).all() and torch.isfinite(experts[0]).all()
    buf = opt.state[fused[0]]["momentum_buffer"]
    assert torch.equal(buf[8:16], torch.zeros(8, 16)) and buf[:8].abs().sum() > 0


@pytest.mark.parametrize("gram_space", [False, True])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 3e38])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
def test_one_nonfinite_entry_makes_the_whole_result_nonfinite(gram_space, value, shape):
    """What skip_nonfinite relies on, for the plain and the Gram-space iteration: one NaN/Inf
    makes every entry of the result non-finite (a huge finite entry does not)."""
    G = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    G[0, 3, 5] = value
    out = zeropower(G, 5, "polar_express", gram_space=gram_space).float()
    if math.isfinite(value):
        assert torch.isfinite(out).all()
    else:
        assert not torch.isfinite(out[0]).any()
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("strategy", ["polar_express", "newton_schulz"])
@pytest.mark.parametrize("scale", [1e19, 1e30, 2.0**126])
def test_huge_gradients_are_orthogonalized_like_any_other(strategy, scale):
    """Entries above ~1.8e19 overflowed the fp32 norm: the update was exactly zero. Now the
    result is that of the same matrix scaled down by a power of two (exact), bit for bit."""
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    G[0, 0] = 3.0
    big = (G * scale).to(torch.bfloat16)
    small = big * 2.0 ** -math.floor(math.log2(scale))  # exact: the same bf16 mantissas
    for gram_space in (False, True):
        ref = zeropower(small, 5, strategy, gram_space=gram_space)
        out = zeropower(big, 5, strategy, gram_space=gram_space)
        assert ref.float().abs().sum() > 0
        assert torch.equal(out, ref)
    spec = MatrixSpec(strategy=strategy)
    assert torch.equal(orthogonalize_stack(big[None], spec), orthogonalize_stack(small[None], spec))


def test_ordinary_inputs_are_not_rescaled():
    """The overflow guard is exactly the identity for ordinary inputs."""
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 1e6
    from muon_plugin.orthogonalize import Normalization

    X = G.to(torch.bfloat16)
    Y = X.clone()
    Normalization(1.01).prescale_(Y[None])
    assert torch.equal(X, Y)
