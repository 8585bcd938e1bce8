"""Param-group rules (muon_plugin.param_groups.rules) on the real torchtitan debug models."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan")

from muon_plugin.param_groups.groups import build_param_groups  # noqa: E402
from muon_plugin.param_groups.options import MuonConfig  # noqa: E402
from muon_plugin.param_groups.rules import (  # noqa: E402
    PARAM_CLASSES,
    RuleSet,
    classify,
    default_class,
    strip_fqn,
)
from muon_plugin.param_groups.rules_table import format_rules_table  # noqa: E402


def debug_model(name: str, flavor: str = "debugmodel") -> torch.nn.Module:
    """A torchtitan model built on the meta device (no memory), as the Trainer builds it."""
    from torchtitan.config import JobConfig
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(JobConfig())
    with torch.device("meta"):
        return spec.model_cls(args)


def expected_class(name: str, ndim: int) -> str:
    """An independent statement of the intended classification, by name suffix."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias") or name.endswith("attention.sinks"):
        return "other"
    if re.search(r"(^|\.)\w*norm\.weight$", name):
        return "norm"
    if name == "tok_embeddings.weight":
        return "embedding"
    if name == "output.weight":
        return "output"
    if name.endswith("moe.router.gate.weight"):
        return "router"
    if ".moe.experts." in name:
        assert ndim == 3, name
        return "expert"
    assert ndim == 2, name
    return "matrix"


@pytest.mark.parametrize("model_name", ["llama3", "qwen3", "deepseek_v3", "llama4", "gpt_oss"])
def test_debug_models_classified(model_name: str) -> None:
    model = debug_model(model_name)
    named = list(model.named_parameters())
    got = classify(named)
    n_total = sum(len(v) for v in got.names.values())
    assert n_total == len(named)  # every parameter exactly once
    for name, p in named:
        assert got.class_of(name) == expected_class(name, p.ndim), (name, tuple(p.shape))
    # Muon only ever sees matrices or stacks of matrices
    for c in ("matrix", "expert"):
        assert all(p.ndim >= 2 for p in got.params[c])


def test_llama3_counts() -> None:
    got = classify(debug_model("llama3").named_parameters())
    counts = {c: len(v) for c, v in got.names.items()}
    assert counts == {
        "matrix": 42,  # 6 layers x (wq wk wv wo w1 w2 w3)
        "expert": 0,
        "router": 0,
        "embedding": 1,
        "output": 1,
        "norm": 13,  # 6 x (attention_norm, ffn_norm) + norm
        "other": 0,
    }


def test_qwen3_tied_embedding_counted_once_as_embedding() -> None:
    model = debug_model("qwen3")
    assert model.output.weight is model.tok_embeddings.weight  # tied in the debug flavor
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "output.weight" in all_names
    # even when given every alias, the shared tensor appears once, under its first name
    got = classify(model.named_parameters(remove_duplicate=False))
    assert got.names["embedding"] == ["tok_embeddings.weight"]
    assert got.names["output"] == []
    assert sum(map(len, got.names.values())) == len(list(model.parameters()))
    assert "layers.0.attention.q_norm.weight" in got.names["norm"]


def test_deepseek_v3_moe_classes() -> None:
    got = classify(debug_model("deepseek_v3").named_parameters())
    assert got.names["expert"] and all(".moe.experts.w" in n for n in got.names["expert"])
    assert got.names["router"] and all(
        n.endswith("router.gate.weight") for n in got.names["router"]
    )
    assert any(n.endswith("moe.shared_experts.w1.weight") for n in got.names["matrix"])
    assert any(n.endswith("attention.kv_norm.weight") for n in got.names["norm"])


def test_gpt_oss_biases_and_sinks_are_not_matrices() -> None:
    got = classify(debug_model("gpt_oss").named_parameters())
    other = got.names["other"]
    assert "layers.0.moe.experts.mlp1_bias" in other  # 2-D [E, n] but a bias
    assert "layers.0.attention.sinks" in other
    assert "layers.0.moe.router.gate.bias" in other
    assert "layers.0.moe.experts.mlp1_weight" in got.names["expert"]


def test_wrapper_prefixes_are_stripped() -> None:
    assert (
        strip_fqn("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )
    assert strip_fqn("_orig_mod.norm.weight") == "norm.weight"
    assert strip_fqn("_fsdp_wrapped_module.output.weight") == "output.weight"
    named = [
        ("_orig_mod.tok_embeddings.weight", torch.empty(8, 4)),
        ("_orig_mod.layers.0._checkpoint_wrapped_module.attention.wq.weight", torch.empty(4, 4)),
        ("_orig_mod.layers.0._checkpoint_wrapped_module.attention_norm.weight", torch.empty(4)),
        ("_orig_mod.output.weight", torch.empty(8, 4)),
    ]
    got = classify(named)
    assert [got.class_of(n) for n, _ in named] == ["embedding", "matrix", "norm", "output"]
    # names in the groups are the model's own (unstripped) FQNs
    assert got.names["matrix"] == [named[1][0]]


def test_default_class_edge_cases() -> None:
    assert default_class("layers.0.moe.router.gate.weight", 2) == "router"
    assert default_class("layers.0.moe.expert_bias", 1) == "other"
    assert default_class("scale", 0) == "other"
    assert default_class("conv.weight", 4) == "other"
    assert default_class("layers.0.feed_forward.w1.weight", 2) == "matrix"
    assert default_class("model.embed_tokens.weight", 2) == "embedding"
    assert default_class("lm_head.weight", 2) == "output"
    assert default_class("layers.3.ln_1.weight", 1) == "norm"


def rules_with(**kw) -> RuleSet:
    return MuonConfig(**kw).rules()


def test_user_patterns_glob_and_regex_take_precedence() -> None:
    named = list(debug_model("llama3").named_parameters())
    rules = rules_with(
        output_patterns=["output.*"],
        embedding_patterns=["re:layers\\.0\\.attention\\.w[qk]\\.weight"],
        other_patterns=["layers.5.*norm.weight"],
    )
    got = classify(named, rules)
    assert got.names["output"] == ["output.weight"]
    assert set(got.names["embedding"]) == {
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.0.attention.wk.weight",
    }
    assert set(got.names["other"]) == {
        "layers.5.attention_norm.weight",
        "layers.5.ffn_norm.weight",
    }
    assert len(got.names["matrix"]) == 40


def test_pattern_matching_nothing_is_an_error_naming_it() -> None:
    named = list(debug_model("llama3").named_parameters())
    with pytest.raises(ValueError, match=r"optimizer\.muon\.router_patterns: pattern 'moe\.\*'"):
        classify(named, rules_with(router_patterns=["moe.*"]))


def test_pattern_of_two_classes_is_an_error() -> None:
    named = list(debug_model("llama3").named_parameters())
    with pytest.raises(ValueError, match="output.weight.*output_patterns.*other_patterns"):
        classify(named, rules_with(output_patterns=["output.*"], other_patterns=["*.weight"]))


def test_empty_or_bad_patterns_rejected_when_configured() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.muon\.norm_patterns: empty"):
        MuonConfig(norm_patterns=[""])
    with pytest.raises(ValueError, match=r"optimizer\.muon\.matrix_patterns: invalid regular"):
        MuonConfig(matrix_patterns=["re:(unclosed"])
    with pytest.raises(ValueError, match=r"optimizer\.muon\.output_patterns"):
        MuonConfig(output_patterns="output.*")  # a string, not a list


def test_param_groups_per_class_settings() -> None:
    named = list(debug_model("deepseek_v3").named_parameters())
    rules = rules_with(
        embedding_lr=3e-3, norm_weight_decay=0.0, expert_lr=1e-3, router_algorithm="muon"
    )
    groups, classes = build_param_groups(named, rules, lr=8e-4, weight_decay=0.1)
    assert classes == ["matrix", "expert", "router", "embedding", "output", "norm"]  # no "other"
    by = dict(zip(classes, groups, strict=True))
    assert by["matrix"]["algorithm"] == "muon" and by["matrix"]["lr"] == 8e-4
    assert by["expert"]["lr"] == 1e-3 and by["expert"]["algorithm"] == "muon"
    assert by["router"]["algorithm"] == "muon"
    assert by["embedding"]["lr"] == 3e-3 and by["embedding"]["algorithm"] == "adamw"
    assert by["norm"]["wd"] == 0.0 and by["output"]["wd"] == 0.1
    for g in groups:
        assert set(g) == {"params", "param_names", "algorithm", "lr", "wd"}
        assert len(g["params"]) == len(g["param_names"]) > 0
    assert sum(len(g["params"]) for g in groups) == len(named)
    table = format_rules_table(groups, classes)
    header, _, first = table.splitlines()[:3]
    assert header.split() == [
        "class", "algorithm", "count", "#params", "lr", "muon", "lr", "weight", "decay"
    ]  # fmt: skip
    assert first.split()[:2] == ["matrix", "muon"]
    assert table.splitlines()[-1].startswith("total")


def test_muon_on_vectors_is_an_error() -> None:
    named = list(debug_model("llama3").named_parameters())
    with pytest.raises(ValueError, match=r"norm_algorithm: 'muon' but .*fewer than 2 dimensions"):
        build_param_groups(named, rules_with(norm_algorithm="muon"), lr=1e-3, weight_decay=0.0)


def test_classify_needs_only_ndim() -> None:
    fake = [("a.weight", SimpleNamespace(ndim=2)), ("a_norm.weight", SimpleNamespace(ndim=1))]
    got = classify(fake)
    assert got.names["matrix"] == ["a.weight"] and got.names["norm"] == ["a_norm.weight"]
    assert set(got.names) == set(PARAM_CLASSES)
