"""QK-Clip core on one process: the statistic, the rule and the rescale, against exact logits.

Every layer has fixed weights and inputs and an fp64 ``logits(x)`` listing all pre-softmax
logits, so the max logit per head is known exactly before and after the clip: a clipped head
lands on tau (fp32 tolerance), every other head's rows stay bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch
from qk_clip_support import FusedLayer, GQALayer, MLALayer, boost_rows, causal, head_max, masked
from torch._dynamo.exc import FailOnRecompileLimitHit

from muon_plugin import MuonForeach
from muon_plugin.qk_clip import (
    AttentionHeads,
    ClipRule,
    LayoutDescriptionError,
    LocalLayer,
    QKClip,
    Visibility,
    max_logit_per_head,
    separate_projections,
)

RTOL = 1e-5  # fp32 weights after one multiply by gamma^alpha and one by gamma^(1-alpha)


def inputs(b: int = 2, seq: int = 12, dim: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, seq, dim, generator=torch.Generator().manual_seed(seed))


def snapshot(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


def clip_once(layer, heads, x, tau, **kwargs) -> QKClip:
    clip = QKClip([heads], tau=tau, **kwargs)
    q, k = layer.qk(x)
    clip.record(0, q, k, scale=getattr(layer, "scale", None), visible=Visibility(causal=True))
    clip.step()
    return clip


# ----- the statistic


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_max_logit_matches_fp64_over_chunks(n_kv: int) -> None:
    layer = GQALayer(16, 4, n_kv, 4)
    x = inputs(seq=13)
    exact = head_max(layer.logits(x))
    q, k = layer.qk(x)
    for chunk_bytes in (1, 4 * 13 * 2 * 5 * 3, 2**30):  # one query per chunk, a few, all
        got = max_logit_per_head(q, k, visible=Visibility(causal=True), chunk_bytes=chunk_bytes)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)


def test_visibility_kinds_match_dense_masks() -> None:
    torch.manual_seed(0)
    b, h, seq, d = 2, 3, 10, 4
    q, k = torch.randn(b, h, seq, d) * 3, torch.randn(b, h, seq, d) * 3
    full = (q.double() @ k.double().transpose(-1, -2)) * 0.7
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    same_doc = docs[:, :, None] == docs[:, None, :]
    tri = causal(seq, seq)
    cases = {
        "all": (Visibility(), torch.ones(seq, seq, dtype=torch.bool)),
        "causal": (Visibility(causal=True), tri),
        "window": (Visibility(causal=True, window=(2, 0)), tri & ~causal(seq, seq).tril(-3)),
        "documents": (Visibility(causal=True, documents=docs), tri & same_doc),
        "mask_mod": (
            Visibility(mask_mod=lambda bb, hh, qi, kj: (kj <= qi) & (docs[bb, qi] == docs[bb, kj])),
            tri & same_doc,
        ),
        "dense": (Visibility(dense=tri & same_doc), tri & same_doc),
    }
    for name, (vis, mask) in cases.items():
        mask = mask if mask.dim() == 3 else mask.expand(b, seq, seq)
        exact = masked(full, mask.unsqueeze(1)).amax(dim=(0, 2, 3))
        got = max_logit_per_head(q, k, scale=0.7, visible=vis, chunk_bytes=200)
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("scale", [0.5, -0.5])
def test_bottom_right_causal_chunks_split_at_the_diagonal(scale: float) -> None:
    """Fewer queries than keys (offset Lk - Lq): each chunk's keys left of its first query's
    diagonal are taken unmasked, the rest masked; the scale is applied to each head's maximum
    (positive) or to every logit (otherwise), both equal to the fp64 logits."""
    torch.manual_seed(0)
    b, h, lq, lk, d = 2, 3, 6, 10, 4
    q, k = torch.randn(b, h, lq, d) * 3, torch.randn(b, h, lk, d) * 3
    vis = Visibility(causal=True, offset=lk - lq)
    assert [vis.free_keys(start, lk) for start in (0, 3, 5)] == [5, 8, 10]
    assert (
        Visibility().free_keys(3, lk) == lk
        and Visibility(causal=True, window=(2, 0)).free_keys(3, lk) == 0
    )
    full = (q.double() @ k.double().transpose(-1, -2)) * scale
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq
    exact = masked(full, mask).amax(dim=(0, 2, 3))
    for chunk_bytes in (1, 2 * 3 * 10 * 5 * 2, 2**30):  # one query per chunk, two, all
        got = max_logit_per_head(q, k, scale=scale, visible=vis, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)


def test_head_dependent_mask_mod_and_empty_heads() -> None:
    q, k = torch.ones(1, 2, 3, 2), torch.ones(1, 2, 3, 2)
    got = max_logit_per_head(q, k, scale=1.0, visible=Visibility(mask_mod=lambda b, h, i, j: h > 0))
    assert got[0] == float("-inf") and got[1] == 2.0


# ----- the clip on exact layers


def check_clip(layer, heads, x, tau, expect_clipped: set[int], land=None, **kwargs):
    """Clip once; the heads of ``land`` (default: the clipped ones) land on tau."""
    land = expect_clipped if land is None else land
    before = snapshot(layer)
    s_before = head_max(layer.logits(x))
    clip = clip_once(layer, heads, x, tau, **kwargs)
    s_after = head_max(layer.logits(x))
    for h in range(len(s_before)):
        if h in land:
            assert s_after[h].item() == pytest.approx(tau, rel=RTOL), (h, s_before, s_after)
    report = clip.report()
    assert {h for _, h, _ in report.clipped} == expect_clipped
    for _, h, s in report.clipped:
        assert s == pytest.approx(s_before[h].item(), rel=1e-6)
    return before, s_before, s_after


def test_mha_clipped_heads_land_on_tau_others_bit_identical() -> None:
    layer = GQALayer(16, 4, 4, 4)
    boost_rows(layer.wq.weight, [1, 3], 4, 3.0)
    x = inputs()
    s = head_max(layer.logits(x))
    tau = float((s[1].clamp(max=s[3]) + s[[0, 2]].max()) / 2)  # between the two groups
    before, s_before, s_after = check_clip(layer, layer.heads(), x, tau, {1, 3})
    for h in (0, 2):
        rows = slice(4 * h, 4 * h + 4)
        assert torch.equal(layer.wq.weight[rows], before["wq.weight"][rows])
        assert torch.equal(layer.wk.weight[rows], before["wk.weight"][rows])
        assert s_after[h] == s_before[h]
    assert torch.equal(layer.wv.weight, before["wv.weight"])
    # alpha = 0.5: q and k rows of a clipped head took the same factor sqrt(tau / S)
    for h in (1, 3):
        rows = slice(4 * h, 4 * h + 4)
        fq = layer.wq.weight[rows] / before["wq.weight"][rows]
        fk = layer.wk.weight[rows] / before["wk.weight"][rows]
        expected = math.sqrt(tau / s_before[h].item())
        torch.testing.assert_close(fq, torch.full_like(fq, expected), rtol=1e-6, atol=0)
        torch.testing.assert_close(fk, torch.full_like(fk, expected), rtol=1e-6, atol=0)


def test_alpha_splits_the_factor() -> None:
    layer = GQALayer(16, 2, 2, 4)
    x = inputs()
    s = head_max(layer.logits(x))
    tau = float(s.min()) / 2
    before = snapshot(layer)
    clip_once(layer, layer.heads(), x, tau, alpha=0.25)
    for h in range(2):
        gamma = tau / s[h].item()
        rows = slice(4 * h, 4 * h + 4)
        fq = (layer.wq.weight[rows] / before["wq.weight"][rows]).mean().item()
        fk = (layer.wk.weight[rows] / before["wk.weight"][rows]).mean().item()
        assert fq == pytest.approx(gamma**0.25, rel=1e-6)
        assert fk == pytest.approx(gamma**0.75, rel=1e-6)
    assert head_max(layer.logits(x)).tolist() == pytest.approx([tau, tau], rel=RTOL)


def test_gqa_query_rule_leaves_shared_keys() -> None:
    layer = GQALayer(16, 4, 2, 4)  # heads 0,1 share key 0; heads 2,3 share key 1
    boost_rows(layer.wq.weight, [1], 4, 4.0)
    x = inputs()
    s = head_max(layer.logits(x))
    tau = float(s[[0, 2, 3]].max() * 1.01)
    assert s[1] > tau
    before, s_before, s_after = check_clip(layer, layer.heads(), x, tau, {1}, gqa_rule="query")
    assert torch.equal(layer.wk.weight, before["wk.weight"])  # shared keys untouched
    for h in (0, 2, 3):
        assert s_after[h] == s_before[h]
        rows = slice(4 * h, 4 * h + 4)
        assert torch.equal(layer.wq.weight[rows], before["wq.weight"][rows])


def test_gqa_group_rule_clips_the_whole_group() -> None:
    layer = GQALayer(16, 4, 2, 4)
    boost_rows(layer.wq.weight, [1], 4, 4.0)
    x = inputs()
    s = head_max(layer.logits(x))
    tau = float(s[[0, 2, 3]].max() * 1.01)
    before, s_before, s_after = check_clip(
        layer, layer.heads(), x, tau, {0, 1}, land={1}, gqa_rule="group"
    )
    eta = tau / s_before[1].item()
    assert s_after[0].item() == pytest.approx(s_before[0].item() * eta, rel=RTOL)  # shrunk too
    assert s_after[1].item() == pytest.approx(tau, rel=RTOL)  # the group's max lands on tau
    assert torch.equal(layer.wk.weight[4:], before["wk.weight"][4:])  # group 1 untouched
    assert torch.equal(layer.wq.weight[8:], before["wq.weight"][8:])
    assert torch.equal(s_after[2:], s_before[2:])


@pytest.mark.parametrize("order", ["grouped", "stacked"])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_fused_qkv(order: str, n_kv: int) -> None:
    layer = FusedLayer(16, 4, n_kv, 4, order=order)
    x = inputs()
    s = head_max(layer.logits(x))
    top = int(s.argmax())
    tau = float(s.sort().values[-2] * 1.001) if s.sort().values[-2] < s[top] else float(s[top]) / 2
    expect = {h for h in range(4) if s[h] > tau}
    before = snapshot(layer)
    _, s_before, s_after = check_clip(layer, layer.heads(), x, tau, expect)
    for h in set(range(4)) - expect:
        assert s_after[h] == s_before[h]
    # value rows never move
    hd, rep = 4, 4 // n_kv
    if order == "grouped":
        v_rows = [g * (rep + 2) * hd + (rep + 1) * hd + i for g in range(n_kv) for i in range(hd)]
    else:
        v_rows = list(range((4 + n_kv) * hd, (4 + 2 * n_kv) * hd))
    assert torch.equal(layer.wqkv[v_rows], before["wqkv"][v_rows])


def test_mla_rope_query_takes_gamma_shared_rope_key_untouched() -> None:
    layer = MLALayer()
    x = inputs(dim=16)
    s = head_max(layer.logits(x))
    tau = float(s.median())
    expect = {h for h in range(4) if s[h] > tau}
    assert expect and len(expect) < 4
    before, s_before, s_after = check_clip(layer, layer.heads(), x, tau, expect)
    assert torch.equal(layer.wkv_a, before["wkv_a"])  # shared rope key (and the latent)
    q_rows, kv_rows = 6 + 4, 6 + 5
    for h in range(4):
        gamma = tau / s_before[h].item() if h in expect else 1.0
        nope = layer.wq[h * q_rows : h * q_rows + 6] / before["wq"][h * q_rows : h * q_rows + 6]
        rope = (
            layer.wq[h * q_rows + 6 : (h + 1) * q_rows]
            / before["wq"][h * q_rows + 6 : (h + 1) * q_rows]
        )
        k = (
            layer.wkv_b[h * kv_rows : h * kv_rows + 6]
            / before["wkv_b"][h * kv_rows : h * kv_rows + 6]
        )
        v = slice(h * kv_rows + 6, (h + 1) * kv_rows)
        assert nope.mean().item() == pytest.approx(gamma**0.5, rel=1e-6)
        assert rope.mean().item() == pytest.approx(gamma, rel=1e-6)
        assert k.mean().item() == pytest.approx(gamma**0.5, rel=1e-6)
        assert torch.equal(layer.wkv_b[v], before["wkv_b"][v])
        if h not in expect:
            assert s_after[h] == s_before[h]


def test_momentum_untouched_and_post_hook_order() -> None:
    """The clip runs after the optimizer step and changes only the parameters."""
    layer = GQALayer(16, 4, 4, 4)
    x = inputs()
    opt = MuonForeach([{"params": list(layer.parameters())}], lr=0.02)
    tau = float(head_max(layer.logits(x)).min()) / 2
    clip = QKClip([layer.heads()], tau=tau)
    seen = {}

    def after_step(*_):
        seen["momentum"] = {
            n: opt.state[p]["momentum_buffer"].clone() for n, p in layer.named_parameters()
        }
        clip.step()

    opt.register_step_post_hook(after_step)
    q, k = layer.qk(x)
    clip.record(0, q, k, visible=Visibility(causal=True))
    (q.sum() + k.sum()).backward()
    layer.wv.weight.grad = torch.ones_like(layer.wv.weight)
    opt.step()
    assert clip.report().clipped  # every head was clipped
    for n, p in layer.named_parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], seen["momentum"][n]), n


def test_nonpositive_and_nonfinite_heads_give_warnings_not_nans() -> None:
    layer = GQALayer(16, 6, 6, 4)
    before = snapshot(layer)
    clip = QKClip([layer.heads()], tau=1.0)
    clip.record_max(0, torch.tensor([-5.0, 0.0, float("nan"), float("inf"), float("-inf"), 0.5]))
    clip.step()
    for n, p in layer.named_parameters():
        assert torch.equal(p, before[n]), n  # no head clipped: all factors exactly 1
        assert torch.isfinite(p).all()
    report = clip.report()
    assert report.clipped == []
    assert [h for _, h in report.nonfinite] == [2, 3]
    assert [(h, s) for _, h, s in report.nonpositive] == [(0, -5.0), (1, 0.0)]
    text = "\n".join(report.warnings())
    assert "non-finite max logit" in text and "attn h2" in text
    assert "max logit <= 0" in text and "attn h0 -5" in text


def test_rule_factors_never_divide_by_nonpositive() -> None:
    rule = ClipRule([LocalLayer(4, 4)], tau=2.0, alpha=0.5, gqa_rule="query")
    s = torch.tensor([-1.0, 0.0, 8.0, float("nan")])
    f = rule.factors(s)
    assert torch.isfinite(f).all()
    assert f[:4].tolist() == [1.0, 1.0, 0.5, 1.0]  # sqrt(2 / 8)
    assert f[4:8].tolist() == [1.0, 1.0, 0.5, 1.0]
    assert f[-1] == 1.0


def test_no_recording_without_autograd() -> None:
    layer = GQALayer(16, 4, 4, 4)
    x = inputs()
    clip = QKClip([layer.heads()], tau=1e-3)
    before = snapshot(layer)
    with torch.no_grad():
        clip.record(0, *layer.qk(x))
    with torch.inference_mode():
        clip.record(0, *layer.qk(x))
    clip.step()
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())
    assert clip.report().layer_max == [float("-inf")]


def test_microbatches_fold_into_one_max() -> None:
    """Gradient accumulation and recomputation: the statistic is the max over every forward of
    the step, the same as one forward of the whole batch, however often a microbatch repeats."""
    layer = GQALayer(16, 4, 2, 4)
    x = inputs(b=4)
    whole = QKClip([layer.heads()], tau=1e9)
    whole.record(0, *layer.qk(x), visible=Visibility(causal=True))
    parts = QKClip([layer.heads()], tau=1e9)
    for mb in (x[:1], x[1:3], x[1:3], x[3:]):  # x[1:3] twice: a recomputed forward
        parts.record(0, *layer.qk(mb), visible=Visibility(causal=True))
    assert torch.equal(whole.reduced(), parts.reduced())


def test_copies_take_the_same_factors() -> None:
    layer = GQALayer(16, 2, 2, 4)
    x = inputs()
    master = layer.wq.weight.detach().clone().double()
    low = layer.wq.weight.detach().to(torch.bfloat16)
    before = layer.wq.weight.detach().clone()
    tau = float(head_max(layer.logits(x)).min()) / 2
    clip_once(layer, layer.heads(), x, tau, copies={id(layer.wq.weight): [master, low]})
    factor = layer.wq.weight / before
    torch.testing.assert_close(master / before.double(), factor.double(), rtol=1e-6, atol=0)
    expected_low = (before.to(torch.bfloat16).float() * factor).to(torch.bfloat16)
    torch.testing.assert_close(low, expected_low, rtol=1e-2, atol=0)


def test_descriptions_that_do_not_fit_are_refused() -> None:
    layer = GQALayer(16, 4, 2, 4)
    with pytest.raises(LayoutDescriptionError, match=r"'attn'.*wk.weight has 8 rows.*expected 16"):
        separate_projections(
            "attn", ("wq.weight", layer.wq.weight), ("wk.weight", layer.wk.weight), 4, 4, 4
        )
    with pytest.raises(LayoutDescriptionError, match="4 query heads are not a multiple of 3"):
        AttentionHeads("attn", 4, 3, ())
    blocks = layer.heads().blocks
    with pytest.raises(LayoutDescriptionError, match=r"query heads \[3\] have no rows"):
        AttentionHeads("attn", 4, 2, tuple(b for b in blocks if (b.part, b.head) != ("q", 3)))
    with pytest.raises(LayoutDescriptionError, match="overlapping row blocks in wq.weight"):
        AttentionHeads("attn", 4, 2, (*blocks, blocks[0]))
    with pytest.raises(ValueError, match="described by two attention layers"):
        QKClip([layer.heads("a"), layer.heads("b")], tau=1.0)


def test_report_lines() -> None:
    layer = GQALayer(16, 4, 4, 4)
    clip = QKClip([layer.heads("layers.0.attention")], tau=2.0)
    clip.record_max(0, torch.tensor([1.0, 8.0, 3.0, 0.5]))
    clip.step()
    report = clip.report()
    line = report.format()
    assert line.startswith("QK-Clip: max logit 8 (layers.0.attention), 2 heads clipped at tau 2")
    assert "layers.0.attention h1 8, layers.0.attention h2 3" in line
    assert report.metrics()["qk_clip/heads_clipped"] == 2
    assert report.metrics()["qk_clip/max_logit_layer_0"] == 8.0
    clip.record_max(0, torch.tensor([1.0, 2.0, 1.5, 0.5]))
    clip.step()
    line = clip.report().format()
    assert "0 heads clipped" in line
    assert "previous step now: layers.0.attention h1 2, layers.0.attention h2 1.5" in line
    assert clip.report().clipped_total == 2


def test_selective_activation_checkpointing_neither_caches_nor_breaks(monkeypatch) -> None:
    """Under selective activation checkpointing that saves every matmul, the statistic's own
    matmuls stay out of the checkpoint's cache (no memory kept, no 'cached tensor mutated'),
    the recomputation in the backward is not computed again, and the gradients are those of a
    plain run."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    import muon_plugin.qk_clip.clip as clip_module

    layer = GQALayer(16, 4, 2, 4)
    x = inputs().requires_grad_()
    clip = QKClip([layer.heads()], tau=1e9)
    cached: list = []
    calls = []
    count = clip_module.max_logit_per_head
    monkeypatch.setattr(
        clip_module, "max_logit_per_head", lambda *a, **k: calls.append(1) or count(*a, **k)
    )

    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute and func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
            cached.append(func)
        return (
            CheckpointPolicy.MUST_SAVE if "mm" in str(func) else CheckpointPolicy.PREFER_RECOMPUTE
        )

    def attention(t):
        q, k = layer.qk(t)
        clip.record(0, q, k, visible=Visibility(causal=True))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1), is_causal=True
        )

    out = checkpoint(
        attention,
        x,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
    )
    recorded = clip._running.clone()
    out.square().sum().backward()  # recomputes attention(): not recorded a second time
    assert torch.equal(clip._running, recorded) and len(calls) == 1
    assert len(cached) == 2  # the model's two projections (q, k), not the statistic's products
    grad = x.grad.clone()
    x.grad = None
    attention(x).square().sum().backward()
    torch.testing.assert_close(x.grad, grad)


def test_reentrant_checkpointing_records_the_recomputation() -> None:
    """Reentrant checkpointing runs the forward without autograd (not recorded) and the
    recomputation in the backward with it: that one is recorded, once."""
    from torch.utils.checkpoint import checkpoint

    layer = GQALayer(16, 4, 2, 4)
    x = inputs().requires_grad_()
    plain = QKClip([layer.heads()], tau=1e9)
    plain.record(0, *layer.qk(x), visible=Visibility(causal=True))
    clip = QKClip([layer.heads()], tau=1e9)

    def attention(t):
        q, k = layer.qk(t)
        clip.record(0, q, k, visible=Visibility(causal=True))
        return (q.sum(-1, keepdim=True) * k.repeat_interleave(2, 1)).sum()

    out = checkpoint(attention, x, use_reentrant=True)
    assert clip._forwards == [0] and torch.isinf(clip._running).all()
    out.backward()
    assert clip._forwards == [0]
    assert torch.equal(clip.reduced(), plain.reduced())


def test_flex_path_masks_and_plumbing_on_cpu(monkeypatch) -> None:
    """The FlexAttention path (CUDA only) checked on a CPU: each visibility as one mask_mod
    gives the chunked path's mask (torch's own ``create_mask``), and the path's call (zero V,
    GQA, max over batch and queries) gives the chunked path's maxima when FlexAttention's
    ``max_scores`` is played by a dense reference."""
    import torch.nn.attention.flex_attention as flex

    import muon_plugin.qk_clip.logits as logits

    b, hq, hk, seq, d = 2, 4, 2, 10, 4
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    dense = (docs[:, :, None] == docs[:, None, :]) & causal(seq, seq)
    cases = {
        "causal": Visibility(causal=True),
        "window": Visibility(causal=True, window=(2, 0)),
        "documents": Visibility(causal=True, documents=docs),
        "dense": Visibility(dense=dense),
        "mask_mod": Visibility(mask_mod=lambda bb, h, i, j: (j <= i) & (h != 1)),
    }
    for name, vis in cases.items():
        want = vis.chunk(b, hq, 0, seq, seq, torch.device("cpu")).expand(b, hq, seq, seq)
        got = flex.create_mask(vis.flex_mask_mod(hq), b, hq, seq, seq, device="cpu")
        assert torch.equal(got, want), name

    def fake_flex(q, k, v, *, block_mask, scale, enable_gqa, return_aux):
        assert v.shape == (b, hk, seq, logits.FLEX_V_DIM) and enable_gqa
        assert return_aux.max_scores
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        mask = flex.create_mask(block_mask.mask_mod, b, hq, seq, seq, device="cpu")
        scores = (q.float() @ kk.float().transpose(-1, -2) * scale).masked_fill(~mask, -torch.inf)
        return None, flex.AuxOutput(lse=None, max_scores=scores.amax(-1))

    monkeypatch.setattr(logits, "_flex_available", lambda q, flex=True: True)
    monkeypatch.setitem(logits._flex_state, "flex", fake_flex)
    monkeypatch.setitem(logits._flex_state, "create", flex.create_block_mask)
    monkeypatch.setitem(logits._flex_state, "masks", {})
    torch.manual_seed(0)
    q, k = torch.randn(b, hq, seq, d) * 2, torch.randn(b, hk, seq, d) * 2
    for name, vis in cases.items():
        got = max_logit_per_head(q, k, scale=0.5, visible=vis)
        monkeypatch.setattr(logits, "_flex_available", lambda q, flex=True: False)
        want = max_logit_per_head(q, k, scale=0.5, visible=vis)
        monkeypatch.setattr(logits, "_flex_available", lambda q, flex=True: True)
        torch.testing.assert_close(got, want, msg=name)
    assert len(logits._flex_state["masks"]) == 2  # causal and window masks are cached


@pytest.mark.parametrize(
    "error, why",
    [
        (RuntimeError("no kernel for this shape"), "RuntimeError('no kernel for this shape')"),
        # fullgraph: past torch's recompile limit a call raises (a plain compile would run
        # FlexAttention unfused and materialize every score)
        (FailOnRecompileLimitHit("fullgraph=True"), "recompile limit was reached"),
    ],
    ids=["unsupported", "recompile-limit"],
)
def test_a_failing_flex_path_falls_back_once_with_a_warning(
    error: Exception, why: str, monkeypatch, caplog
) -> None:
    """FlexAttention is compiled with ``fullgraph=True``; when its call raises, this and every
    later statistic takes the exact chunked path, and one warning says why."""
    import muon_plugin.qk_clip.logits as logits

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((fn.__name__, kwargs))

        def broken(*args, **kw):
            raise error

        return broken

    def unless_failed(q, flex=True) -> bool:
        return not logits._flex_state.get("failed")

    monkeypatch.setattr(logits, "_flex_available", unless_failed)
    monkeypatch.setattr(logits.torch, "compile", fake_compile)
    monkeypatch.setattr(logits, "_flex_state", {"masks": {"x": None}, "failed": False})
    q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    vis = Visibility(causal=True)
    with caplog.at_level("WARNING"):
        got = max_logit_per_head(q, k, visible=Visibility(causal=True, block_mask=object()))
    assert compiled == [("flex_attention", {"fullgraph": True})]
    assert "the FlexAttention max-logit path failed" in caplog.text and why in caplog.text
    assert logits._flex_state["failed"]
    monkeypatch.setattr(logits, "_flex_available", lambda q, flex=True: False)
    assert torch.equal(got, max_logit_per_head(q, k, visible=vis))


def test_this_torch_flex_attention_returns_max_scores() -> None:
    """Every supported torch (>= 2.11) has FlexAttention's ``max_scores``: the check must see it
    (it once looked for dataclass fields on what is a NamedTuple, so CUDA never took the
    Flex path)."""
    import muon_plugin.qk_clip.logits as logits

    assert logits.flex_returns_max_scores()
    assert not logits._flex_available(torch.zeros(1, 1, 1, 1))  # CPU tensors: chunked path


def test_the_flex_switch_is_read_once_and_named_in_the_build_line(monkeypatch) -> None:
    """``MUON_PLUGIN_QK_CLIP_FLEX=0`` is read when the clip is built (a later change of the
    environment changes nothing), the clip passes its choice to every statistic, and the build
    line names the path."""
    import muon_plugin.qk_clip.logits as logits

    layer = GQALayer(16, 4, 2, 4)
    monkeypatch.setenv(logits.FLEX_ENV, "0")
    off = QKClip([layer.heads()], tau=1.0)
    monkeypatch.delenv(logits.FLEX_ENV)
    on = QKClip([layer.heads()], tau=1.0)
    assert (off.flex, on.flex, QKClip([layer.heads()], tau=1.0, flex=False).flex) == (
        False,
        True,
        False,
    )
    seen = []
    monkeypatch.setattr(logits, "_flex_available", lambda q, flex=True: seen.append(flex) or False)
    q, k = layer.qk(inputs())
    for clip in (off, on):
        with torch.enable_grad():
            clip.record(0, q, k, visible=Visibility(causal=True))
    assert seen == [False, True]
    assert on.describe().endswith("; statistic: chunked q.k products")  # CPU parameters
    cuda = torch.device("cuda")
    assert logits.statistic_path(cuda, False) == f"chunked q.k products ({logits.FLEX_ENV}=0)"
    assert logits.statistic_path(cuda, True) == "fused FlexAttention max_scores"


def test_a_compiled_attention_records_the_eager_statistic() -> None:
    """Under ``torch.compile`` (dynamo and AOT autograd; the aot_eager backend keeps the test
    fast) the recording is traced into the graph with no graph break (``fullgraph=True``, as
    torchtitan compiles its blocks): the statistic equals eager's, step after step, and the
    clip after the step works on it."""
    import torch.nn.functional as F

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = GQALayer(16, 4, 2, 4)
            self.clip: QKClip | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = self.layer.qk(x)
            v = self.layer.wv(x).view(*x.shape[:2], -1, 4).transpose(1, 2)
            self.clip.record(0, q, k, visible=Visibility(causal=True))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()

    x = inputs(seq=12)
    eager, compiled = Attention(), Attention()
    eager.clip = QKClip([eager.layer.heads()], tau=4.0)
    compiled.clip = QKClip([compiled.layer.heads()], tau=4.0)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)  # torchtitan's setting
    for _ in range(2):
        eager(x).backward()
        run(x).backward()
        assert torch.equal(compiled.clip._running, eager.clip._running)
        eager.clip.step()
        compiled.clip.step()
        assert torch.equal(compiled.layer.wq.weight, eager.layer.wq.weight)
    assert eager.clip.report().clipped  # tau 4 clips: the second step ran on clipped weights
