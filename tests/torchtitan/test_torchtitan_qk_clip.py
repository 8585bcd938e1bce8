"""QK-Clip on torchtitan 0.2.2's own models, in one process: every attention layer of llama3
(SDPA and FlexAttention), llama4, qwen3 (without qk_norm), deepseek_v3 (MLA, SDPA and Flex)
and gpt_oss (Flex, biases, GQA) is found, hooked and clipped exactly.

Each model runs one forward on fixed tokens; every attention module's input is kept. With tau
at the median head's max logit, the clip runs; then each attention module runs again on its own
input (so an earlier layer's clip does not change a later layer's input): every clipped head's
max logit is tau (fp32 tolerance), every other head's is unchanged, bit for bit.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan")

import torch.nn.attention.flex_attention as flex  # noqa: E402
import torchtitan.models.attention as tt_attention  # noqa: E402
import torchtitan.protocols.train_spec as tt_spec  # noqa: E402
from torchtitan.config import ConfigManager, JobConfig  # noqa: E402

import muon_plugin.torchtitan  # noqa: E402

muon_plugin.torchtitan.activate()
from muon_plugin.adapter.qk_clip import QKClipRefused, build_qk_clip  # noqa: E402
from muon_plugin.param_groups.options import MuonConfig  # noqa: E402
from muon_plugin.qk_clip import Visibility  # noqa: E402
from muon_plugin.torchtitan import builder  # noqa: E402
from muon_plugin.torchtitan.qk_clip import (  # noqa: E402
    describe_attention,
    documents_of,
    qk_clip_group,
)
from muon_plugin.torchtitan.summary import _with_qk_clip_metrics  # noqa: E402

EOS = 7


@pytest.fixture(autouse=True)
def eager_flex_on_cpu(monkeypatch):
    """FlexAttention eagerly on CPU tensors (torchtitan compiles it; torch refuses CPU)."""
    monkeypatch.setattr(
        tt_attention.FlexAttentionWrapper, "_compiled_flex_attn", flex.flex_attention
    )
    monkeypatch.setattr(tt_attention, "_compiled_create_block_mask", flex.create_block_mask)
    monkeypatch.setattr(flex, "_validate_device", lambda *a, **k: None)


def build_model(name: str, flavor: str, **changes) -> torch.nn.Module:
    spec = tt_spec.get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    for key, value in changes.items():
        setattr(args, key, value)
    args.update_from_config(JobConfig())
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
        model.float()  # gpt_oss keeps bf16 weights
        # larger q/k weights: logits of a few units, so tau is far above rounding
        for n, p in model.named_parameters():
            if n.endswith(("wq.weight", "wk.weight", "wq_b.weight", "wkv_b.weight")):
                p.mul_(8.0)
    return model


def tokens(seq: int = 32) -> torch.Tensor:
    t = torch.randint(8, 2048, (2, seq), generator=torch.Generator().manual_seed(0))
    t[0, 11] = EOS  # two documents in the first sequence (block-causal masks)
    return t


def forward(model: torch.nn.Module, t: torch.Tensor) -> None:
    masks = None
    if getattr(model.model_args, "attn_type", "sdpa") != "sdpa":
        masks = model.get_attention_masks(t, SimpleNamespace(eos_id=EOS))
    model(t, attention_masks=masks) if masks is not None else model(t)


TWO = {"n_layers": 2}  # the debug models, two layers deep (seconds on a CPU)


def exact_max(args: tuple, kwargs: dict) -> torch.Tensor:
    """fp64 max logit per head of an inner-attention call: every logit, masked by torch's own
    materialization of the call's mask (``create_mask`` of the BlockMask's mask_mod; SDPA's
    causal triangle)."""
    q, k = args[0].detach().double(), args[1].detach().double()
    b, hq, seq, d = q.shape
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    scale = kwargs.get("scale") or d**-0.5
    block_mask = kwargs.get("block_mask")
    if block_mask is not None:
        mb, mh = block_mask.kv_num_blocks.shape[:2]
        mask = flex.create_mask(block_mask.mask_mod, mb, mh, seq, seq, device="cpu")
    else:
        assert kwargs.get("is_causal", True)
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return logits.amax(dim=(0, 2, 3))


MODELS = {
    "llama3": ("llama3", "debugmodel", TWO),
    "llama3_flex_block_causal": ("llama3", "debugmodel_flex_attn", TWO),
    "llama4": ("llama4", "debugmodel", TWO),
    "qwen3_no_qk_norm": ("qwen3", "debugmodel", {**TWO, "qk_norm": False, "hidden_dim": 256}),
    "deepseek_v3": ("deepseek_v3", "debugmodel", TWO),
    "deepseek_v3_flex": ("deepseek_v3", "debugmodel_flex_attn", TWO),
    "gpt_oss": (
        "gpt_oss",
        "debugmodel",
        {
            **TWO,
            "vocab_size": 2048,
            "moe_inter_dim": 256,
            "n_heads": 16,
            "n_kv_heads": 4,
            "sliding_window_size": 8,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_every_head_of_the_model_is_clipped_exactly(case: str) -> None:
    name, flavor, changes = MODELS[case]
    model = build_model(name, flavor, **changes)
    clip = build_qk_clip([model], MuonConfig(qk_clip_tau=1e30), describe_attention, None)
    n_attention = sum(1 for m in model.modules() if hasattr(m, "inner_attention"))
    assert len(clip.layers) == n_attention > 0
    inputs: list = []
    oracle: dict[str, torch.Tensor] = {}
    keep = []
    for fqn, m in model.named_modules():
        if hasattr(m, "inner_attention"):
            keep.append(
                m.register_forward_pre_hook(
                    lambda mod, args, kwargs: inputs.append((mod, args, kwargs)), with_kwargs=True
                )
            )
            keep.append(
                m.inner_attention.register_forward_pre_hook(
                    lambda mod, args, kwargs, fqn=fqn: oracle.update(
                        {fqn: exact_max(args, kwargs)}
                    ),
                    with_kwargs=True,
                )
            )
    t = tokens()
    forward(model, t)
    for h in keep:
        h.remove()
    s1 = clip.reduced()
    assert torch.isfinite(s1).all() and len(s1) == sum(layer.n_heads for layer in clip.layers)
    # the statistic is the attention's own max logit (fp64 over torch's dense mask)
    for i, layer in enumerate(clip.layers):
        start = clip.rule.q_offsets[i]
        got = s1[start : start + layer.n_heads].double()
        torch.testing.assert_close(got, oracle[layer.name], rtol=1e-5, atol=1e-5)
    tau = float(s1.median())
    clip.rule.tau = tau  # the tau that clips about half the heads of this model
    clip.record_max(0, torch.full_like(s1[: clip.ranges[0].n_q], float("-inf")))
    clip._running.copy_(s1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.step()
    for mod, args, kwargs in inputs:
        mod(*args, **kwargs)
    s2 = clip.reduced()
    clipped = s1 > tau
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(s2[clipped], torch.full_like(s2[clipped], tau), rtol=2e-5, atol=0)
    assert torch.equal(s2[~clipped], s1[~clipped])
    # only q / k rows moved: values, output projections, norms, MLPs, sinks are as they were
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    allowed = ("wq.weight", "wk.weight", "wq.bias", "wk.bias", "wq_b.weight", "wkv_b.weight")
    assert moved and all(n.endswith(allowed) for n in moved), sorted(moved)


def test_wrapped_attention_modules_are_described_once() -> None:
    """torchtitan compiles deepseek_v3's attention modules one by one (``torch.compile`` wraps
    each in an ``OptimizedModule``, which forwards attribute access to the module it wraps);
    activation checkpointing wraps modules too. Each attention is one site, named without the
    wrapper's component, as in the unwrapped model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = build_model("deepseek_v3", "debugmodel", **TWO)
    model = copy.deepcopy(plain)
    for i, block in enumerate(model.layers.values()):
        wrap = torch.compile if i % 2 == 0 else checkpoint_wrapper
        block.attention = wrap(block.attention)
    want = build_qk_clip([plain], MuonConfig(qk_clip_tau=1.0), describe_attention, None)
    got = build_qk_clip([model], MuonConfig(qk_clip_tau=1.0), describe_attention, None)
    assert [layer.name for layer in got.layers] == [layer.name for layer in want.layers]
    assert len(got.layers) == len(model.layers) > 1


def test_qk_norm_is_refused_with_the_way_out() -> None:
    model = build_model("qwen3", "debugmodel", **TWO)
    with pytest.raises(QKClipRefused, match=r"layers\.0\.attention \(Attention\).*qk_norm.*unset"):
        build_qk_clip([model], MuonConfig(qk_clip_tau=10.0), describe_attention, None)


def test_unknown_attention_and_context_parallel_are_refused() -> None:
    model = build_model("llama3", "debugmodel", **TWO)
    model.layers["0"].attention.inner_attention = torch.nn.Identity()
    with pytest.raises(QKClipRefused, match=r"layers\.0\.attention\.inner_attention is a Identity"):
        build_qk_clip([model], MuonConfig(qk_clip_tau=10.0), describe_attention, None)
    with pytest.raises(QKClipRefused, match="context_parallel_degree = 2"):
        qk_clip_group(SimpleNamespace(cp=2))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(QKClipRefused, match="no attention module"):
        build_qk_clip([plain], MuonConfig(qk_clip_tau=10.0), describe_attention, None)
    # a pipeline stage without attention layers (its data-parallel peers hold the same stage)
    stage = build_qk_clip(
        [plain], MuonConfig(qk_clip_tau=10.0), describe_attention, None, pipeline=True
    )
    assert stage is None
    assert build_qk_clip([plain], MuonConfig(), describe_attention, None) is None


def test_varlen_documents_and_hook() -> None:
    cu = torch.tensor([0, 3, 8, 12, 16], dtype=torch.int32)  # B = 2, L = 8
    assert documents_of(cu, 2, 8).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 2, 2, 3, 3, 3, 3]]
    seen = {}
    inner = tt_attention.VarlenAttentionWrapper()
    from muon_plugin.torchtitan.qk_clip import visibility_hook

    visibility_hook("attn", inner, lambda q, k, **kw: seen.update(kw))
    meta = tt_attention.VarlenMetadata(cu, cu, 5, 5)
    q = torch.zeros(2, 2, 8, 4)
    (hook,) = inner._forward_pre_hooks.values()
    hook(inner, (q, q, q, meta), {"scale": 0.5})
    assert seen["scale"] == 0.5
    vis: Visibility = seen["visible"]
    assert vis.causal and torch.equal(vis.documents, documents_of(cu, 2, 8))


def test_container_clips_after_every_step_before_later_hooks() -> None:
    model = build_model("llama3", "debugmodel", n_layers=1)
    cfg = ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            "muon_plugin.torchtitan",
            "--optimizer.name",
            "muon",
            "--optimizer.lr",
            "0",
            "--optimizer.muon.qk_clip_tau",
            "1e-3",
        ]
    )
    container = builder.build_muon_optimizers(
        [model], cfg.optimizer, SimpleNamespace(cp=1, get_optional_mesh=lambda name: None)
    )
    clip = container.job.qk_clip
    assert clip is not None and "qk-clip tau 0.001 alpha 0.5 gqa query" in (
        container.job.format_build_summary()
    )
    order = []
    container.register_step_post_hook(lambda *a, **k: order.append(clip.steps))
    forward(model, tokens())
    model(tokens()).sum().backward()
    container.step()
    assert order == [1]  # the clip ran first
    report = clip.report()
    assert len(report.clipped) == sum(layer.n_heads for layer in clip.layers)
    processor = SimpleNamespace(optimizers=container)
    args, kwargs = _with_qk_clip_metrics(processor, (2.0, 0.5), {})
    assert kwargs["extra_metrics"]["qk_clip/heads_clipped"] == len(report.clipped)
    args, kwargs = _with_qk_clip_metrics(processor, (2.0, 0.5, {"x": 1}), {})
    assert args[2]["x"] == 1 and "qk_clip/max_logit" in args[2]
