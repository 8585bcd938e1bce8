"""QK-Clip on torchtune's ``MultiHeadAttention``, in one process: the tiny llama3_2 model of
``configs/torchtune_llama3_2_muon.yaml`` (GQA: 4 query heads, 2 key heads).

- the recorded max logit per head is the attention call's own (fp64 over its q, k and mask:
  causal, a dense boolean mask, a FlexAttention ``BlockMask``); the wrapped call returns what
  it returned before;
- after a clip at the median head, each attention module rerun on its own input gives tau for
  every clipped head and an unchanged max for every other; only ``q_proj`` rows move (the
  default GQA rule leaves the shared keys);
- per-head q/k norms are refused with the key to remove.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
from torchtune import config

from muon_plugin.adapter.qk_clip import QKClipRefused, build_qk_clip
from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.torchtune.qk_clip import describe_attention

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "torchtune_llama3_2_muon.yaml"


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = config.instantiate(OmegaConf.load(CONFIG).model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


def exact_max(q, k, mask, is_causal) -> torch.Tensor:
    q, k = q.detach().double(), k.detach().double()
    seq = q.shape[2]
    if mask is None:
        visible = torch.ones(seq, seq, dtype=torch.bool)
        visible = visible.tril() if is_causal else visible
    elif isinstance(mask, torch.Tensor):
        visible = mask[:, None]
    else:
        mb, mh = mask.kv_num_blocks.shape[:2]
        visible = create_mask(mask.mask_mod, mb, mh, seq, seq, device="cpu")
    logits = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~visible, float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def doc_mask(seq: int) -> torch.Tensor:
    docs = torch.tensor([[0] * 5 + [1] * (seq - 5), [0] * seq])
    return (docs[:, :, None] == docs[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()


@pytest.mark.parametrize("mask_kind", ["causal", "dense", "block_mask"])
def test_every_head_is_clipped_exactly(mask_kind: str, monkeypatch) -> None:
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *a, **k: None)  # eager Flex on CPU
    model = tiny_llama()
    seq = 16
    tokens = torch.randint(0, 2048, (2, seq), generator=torch.Generator().manual_seed(0))
    dense = doc_mask(seq)
    mask = {
        "causal": None,
        "dense": dense,
        "block_mask": create_block_mask(
            lambda b, h, i, j: dense[b, i, j], 2, None, seq, seq, device="cpu"
        ),
    }[mask_kind]
    attention = [(n, m) for n, m in model.named_modules() if hasattr(m, "_attention_call")]
    oracle, inputs = {}, []
    for n, m in attention:

        def watch(q, k, v, mask=None, dropout_p=0.0, is_causal=True, n=n, call=m._attention_call):
            oracle[n] = exact_max(q, k, mask, is_causal)
            if not isinstance(mask, (torch.Tensor, type(None))):  # torchtune's CPU path: SDPA
                return flex_attention(q, k, v, block_mask=mask)
            return call(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

        m._attention_call = watch
        m.register_forward_pre_hook(
            lambda mod, a, kw: inputs.append((mod, a, dict(kw))), with_kwargs=True
        )
    plain = model(tokens, mask=mask)
    oracle.clear()
    inputs.clear()
    clip = build_qk_clip([model], MuonConfig(qk_clip_tau=1e30), describe_attention, None)
    assert [layer.name for layer in clip.layers] == [n for n, _ in attention]
    assert all((layer.n_heads, layer.n_kv_heads) == (4, 2) for layer in clip.layers)
    assert torch.equal(model(tokens, mask=mask), plain)  # the wrapped call changes nothing
    s1 = clip.reduced()
    for i, layer in enumerate(clip.layers):
        got = s1[clip.rule.q_offsets[i] : clip.rule.q_offsets[i] + 4].double()
        torch.testing.assert_close(got, oracle[layer.name], rtol=1e-5, atol=1e-5)
    tau = float(s1.median())
    clip.rule.tau = tau
    clip._running.copy_(s1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.step()
    for mod, a, kw in inputs[: len(attention)]:
        mod(*a, **kw)
    s2 = clip.reduced()
    clipped = s1 > tau
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(s2[clipped], torch.full_like(s2[clipped], tau), rtol=2e-5, atol=0)
    assert torch.equal(s2[~clipped], s1[~clipped])
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.endswith("q_proj.weight") for n in moved), sorted(moved)


def test_qk_norm_is_refused_naming_the_key() -> None:
    model = tiny_llama()
    model.layers[0].attn.q_norm = torch.nn.RMSNorm(32)
    with pytest.raises(QKClipRefused, match=r"layers\.0\.attn \(MultiHeadAttention\).*q_norm"):
        build_qk_clip([model], MuonConfig(qk_clip_tau=1.0), describe_attention, None)


def test_section_keys_are_validated_and_reach_the_clip() -> None:
    from muon_plugin.torchtune import TorchtuneConfigError
    from muon_plugin.torchtune.options import parse_optimizer_section

    section = parse_optimizer_section({"qk_clip_tau": 100, "qk_clip_gqa": "group"})
    assert section.muon.qk_clip_tau == 100 and section.muon.qk_clip_gqa == "group"
    with pytest.raises(TorchtuneConfigError, match=r"^optimizer\.qk_clip_tau: invalid value -1"):
        parse_optimizer_section({"qk_clip_tau": -1})
    with pytest.raises(TorchtuneConfigError, match=r"optimizer\.qk_clip_alpha: invalid value 2"):
        parse_optimizer_section({"qk_clip_alpha": 2})


def test_the_readmes_yaml_section_builds_with_qk_clip() -> None:
    """The README's QK-Clip ``optimizer:`` block: valid, its options as it says."""

    from qk_clip_readme import blocks

    from muon_plugin.torchtune.options import parse_optimizer_section

    (yaml,) = blocks("yaml")
    section = dict(OmegaConf.create(yaml).optimizer)
    assert section.pop("_component_") == "muon_plugin.torchtune.muon"
    muon = parse_optimizer_section(section).muon
    assert (muon.qk_clip_tau, muon.qk_clip_gqa) == (100.0, "query")
