"""QK-Clip on torchtitan 0.3's own models, in one process: llama3 (fused ``wqkv``, FlexAttention
with document masks), qwen3 without qk_norm (``QKVLinear``, GQA), deepseek_v3 (MLA) and gpt_oss
(biases, sinks, sliding windows).

As for 0.2.2 (``tests/torchtitan/test_torchtitan_qk_clip.py``): the recorded max logit per head
equals the attention's own (fp64 over torch's dense mask of the call's ``BlockMask``); after a clip
at the median head each attention module, rerun on its own input, gives tau for every clipped head
and an unchanged max for every other; only query / key rows move.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.attention.flex_attention as flex  # noqa: E402

from muon_plugin.adapter.qk_clip import QKClipRefused, build_qk_clip  # noqa: E402
from muon_plugin.param_groups.options import MuonConfig  # noqa: E402
from muon_plugin.torchtitan03 import cpu_mode as cpu  # noqa: E402
from muon_plugin.torchtitan03.qk_clip import (  # noqa: E402
    describe_attention,
    qk_clip_group,
    remember_parallel_dims,
    remembered_parallel_dims,
)

cpu.eager_flex_attention_on_cpu()


def shrink(config, **changes):
    """``config`` (a dataclass tree) with every field named in ``changes`` replaced, at any
    depth (layer counts, head counts, vocab, ...)."""
    if not dataclasses.is_dataclass(config):
        return config
    updates = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in changes:
            updates[f.name] = changes[f.name]
        elif dataclasses.is_dataclass(value):
            updates[f.name] = shrink(value, **changes)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            updates[f.name] = [shrink(v, **changes) for v in value]
    try:
        return dataclasses.replace(config, **updates)
    except (TypeError, ValueError):
        return config


def build(name: str, **changes) -> torch.nn.Module:
    import importlib

    registry = importlib.import_module(f"torchtitan.models.{name}").model_registry
    spec = registry("debugmodel", attn_backend="flex")
    config = shrink(spec.model, **changes)
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    if name == "gpt_oss":  # its experts compute in bf16 only (grouped mm): not attention
        for block in model.layers.values():
            block.moe = torch.nn.Identity()
    with torch.no_grad():
        model.float()
        for n, p in model.named_parameters():
            if n.endswith(("wq.weight", "wk.weight", "wqkv.weight", "wq_b.weight", "wkv_b.weight")):
                p.mul_(8.0)
    return model


def positions() -> torch.Tensor:
    pos = torch.arange(32).repeat(2, 1)
    pos[0, 11:] = torch.arange(21)  # two documents in the first sequence
    return pos


def exact_max(args: tuple, kwargs: dict) -> torch.Tensor:
    q, k = (t.detach().double().transpose(1, 2) for t in args[:2])  # [B, L, N, D] -> BNLD
    b, hq, seq, d = q.shape
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    scale = kwargs.get("scale") or d**-0.5
    bm = kwargs["attention_masks"]
    mb, mh = bm.kv_num_blocks.shape[:2]
    mask = flex.create_mask(bm.mask_mod, mb, mh, seq, seq, device="cpu")
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return logits.amax(dim=(0, 2, 3))


MODELS = {
    "llama3": {},
    "deepseek_v3": {},
    "gpt_oss": {},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_head_of_the_model_is_clipped_exactly(name: str) -> None:
    model = build(name, **MODELS[name])
    clip = build_qk_clip([model], MuonConfig(qk_clip_tau=1e30), describe_attention, None)
    inputs, oracle, keep = [], {}, []
    for fqn, m in model.named_modules():
        if hasattr(m, "inner_attention"):
            keep.append(
                m.register_forward_pre_hook(
                    lambda mod, a, kw: inputs.append((mod, a, kw)), with_kwargs=True
                )
            )
            keep.append(
                m.inner_attention.register_forward_pre_hook(
                    lambda mod, a, kw, fqn=fqn: oracle.update({fqn: exact_max(a, kw)}),
                    with_kwargs=True,
                )
            )
    tokens = torch.randint(8, 2000, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = positions()
    model(tokens, positions=pos, attention_masks=model.get_attention_masks(positions=pos))
    for h in keep:
        h.remove()
    assert len(clip.layers) == len(oracle) > 0
    s1 = clip.reduced()
    for i, layer in enumerate(clip.layers):
        got = s1[clip.rule.q_offsets[i] : clip.rule.q_offsets[i] + layer.n_heads].double()
        torch.testing.assert_close(got, oracle[layer.name], rtol=1e-5, atol=1e-5)
    tau = float(s1.median())
    clip.rule.tau = tau
    clip._running.copy_(s1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.step()
    for mod, a, kw in inputs:
        mod(*a, **kw)
    s2 = clip.reduced()
    clipped = s1 > tau
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(s2[clipped], torch.full_like(s2[clipped], tau), rtol=2e-5, atol=0)
    assert torch.equal(s2[~clipped], s1[~clipped])
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    allowed = ("wq.weight", "wk.weight", "wq.bias", "wk.bias", "wqkv.weight", "wqkv.bias")
    allowed += ("wq_b.weight", "wkv_b.weight")
    assert moved and all(n.endswith(allowed) for n in moved), sorted(moved)


def test_qk_norm_and_context_parallel_are_refused() -> None:
    model = build("qwen3")
    with pytest.raises(QKClipRefused, match=r"layers\.0\.attention \(GQAttention\).*qk_norm"):
        build_qk_clip([model], MuonConfig(qk_clip_tau=10.0), describe_attention, None)
    with pytest.raises(QKClipRefused, match="context_parallel_degree = 2"):
        qk_clip_group(SimpleNamespace(cp=2))


def test_the_container_finds_the_trainers_parallel_dims() -> None:
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    remember_parallel_dims()
    remember_parallel_dims()  # idempotent
    from muon_plugin.torchtitan03 import qk_clip

    dims = ParallelDims.from_config(ParallelismConfig(), 1)
    assert remembered_parallel_dims() is dims
    qk_clip._parallel_dims.clear()
    one_process = SimpleNamespace(cp=1, get_optional_mesh=lambda name: None)
    assert qk_clip_group(one_process) is None  # nothing to reduce over


def test_options_from_the_config_and_its_toml_table(tmp_path) -> None:
    """``optimizer.muon.qk_clip_*`` in the Python config or in the ``muon_toml`` table: the
    container clips; a bad value names its key."""
    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    toml = tmp_path / "m.toml"
    toml.write_text('[optimizer.muon]\nqk_clip_tau = 50.0\nqk_clip_gqa = "group"\n')
    model = build("llama3")
    container = MuonOptimizersContainer.Config(muon_toml=str(toml)).build(model_parts=[model])
    clip = container.job.qk_clip
    assert clip is not None and clip.tau == 50.0 and clip.rule.gqa_rule == "group"
    assert "qk-clip tau 50 alpha 0.5 gqa group" in container.job.format_build_summary()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    container.state_dict()  # torchtitan 0.3's init step (zero grads, lr 0): the clip is a no-op
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match=r"optimizer\.muon\.qk_clip_alpha: invalid value 2"):
        MuonOptimizersContainer.Config(muon=MuonConfig(qk_clip_alpha=2))
    toml.write_text("[optimizer.muon]\nqk_clip_tau = -3.0\n")
    with pytest.raises(ValueError, match=r"optimizer\.muon\.qk_clip_tau: invalid value -3\.0"):
        MuonOptimizersContainer.Config(muon_toml=str(toml)).build(model_parts=[model])


def test_the_readmes_python_line_clips() -> None:
    """The README's torchtitan 0.3 line, as written, builds a container that clips."""
    import re

    from qk_clip_readme import section

    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    (line,) = re.findall(r"`optimizer=(MuonOptimizersContainer\.Config\(.*?\))`", section())
    config = eval(
        line, {"MuonOptimizersContainer": MuonOptimizersContainer, "MuonConfig": MuonConfig}
    )
    container = config.build(model_parts=[build("llama3")])
    assert container.job.qk_clip is not None and container.job.qk_clip.tau == 100.0
