"""The torchtune optimizer component in-process: the YAML ``optimizer:`` section of
``configs/torchtune_llama3_2_muon.yaml`` built by torchtune's ``config.instantiate`` on the
tiny llama3_2 model's named parameters.

- the groups are the shared rule engine's (``muon_param_groups``, the torchtitan plugins'
  rules): matrices on Muon; the embedding, the output head and the norms on AdamW, with the
  section's per-class weight decays;
- per-class lr / weight decay / algorithm and extra patterns from the section reach the groups;
- errors name the YAML key (``optimizer.<key>``); plain ``model.parameters()`` (torchtune's stock
  recipes) and ``optimizer_in_bwd`` are refused naming the way out;
- the docs' YAML example builds the same optimizer as the config it quotes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config

from muon_plugin import muon_param_groups
from muon_plugin.torchtune import TorchtuneConfigError
from muon_plugin.torchtune.checks import check_recipe_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "torchtune_llama3_2_muon.yaml"
DOCS = ROOT / "README.md"  # its TorchTune section

MATRIX_SUFFIXES = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")


@pytest.fixture(scope="module")
def cfg():
    return OmegaConf.load(CONFIG)


@pytest.fixture(scope="module")
def model(cfg):
    torch.manual_seed(0)
    return config.instantiate(cfg.model)


def build(cfg, model, **overrides):
    section = OmegaConf.merge(cfg.optimizer, OmegaConf.create(overrides))
    return config.instantiate(section, list(model.named_parameters()))


def groups_by_class(opt) -> dict[str, dict]:
    """Each group under the class its first parameter belongs to in the tiny llama."""
    first = {
        "layers.0.attn.q_proj.weight": "matrix",
        "tok_embeddings.weight": "embedding",
        "output.weight": "output",
        "layers.0.sa_norm.scale": "norm",
    }
    return {first.get(g["param_names"][0], g["param_names"][0]): g for g in opt.param_groups}


def test_config_section_applies_the_class_rules(cfg, model) -> None:
    opt = build(cfg, model)
    groups = groups_by_class(opt)
    assert set(groups) == {"matrix", "embedding", "output", "norm"}
    algorithms = {c: g["algorithm"] for c, g in groups.items()}
    assert algorithms == {
        "matrix": "muon",
        "embedding": "adamw",
        "output": "adamw",
        "norm": "adamw",
    }
    suffixes = {n.rsplit(".", 2)[-2] for n in groups["matrix"]["param_names"]}
    assert suffixes == set(MATRIX_SUFFIXES)
    assert len(groups["matrix"]["params"]) == 7 * cfg.model.num_layers
    assert len(groups["norm"]["params"]) == 2 * cfg.model.num_layers + 1
    # The section's weight decays: 0.1 by default, 0 for norms and the embedding.
    wds = {c: g["wd"] for c, g in groups.items()}
    assert wds == {"matrix": 0.1, "embedding": 0.0, "output": 0.1, "norm": 0.0}
    assert {g["lr"] for g in opt.param_groups} == {cfg.optimizer.lr}
    assert groups["matrix"]["lr_adjust"] == "match_rms_adamw"
    assert groups["embedding"]["adam_betas"] == (0.9, 0.95)

    # Exactly the shared rule engine's groups (the torchtitan plugins' rules).
    core = muon_param_groups(
        model,
        lr=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay,
        norm_weight_decay=0.0,
        embedding_weight_decay=0.0,
    )
    keys = ("param_names", "algorithm", "lr", "wd")
    assert [{k: g[k] for k in keys} for g in opt.param_groups] == [
        {k: g[k] for k in keys} for g in core
    ]
    for g in opt.param_groups:
        named = dict(model.named_parameters())
        assert all(p is named[n] for p, n in zip(g["params"], g["param_names"], strict=True))


def test_per_class_settings_and_patterns(cfg, model) -> None:
    opt = build(
        cfg,
        model,
        output_algorithm="muon",
        embedding_lr=0.01,
        matrix_weight_decay=0.05,
        other_patterns=["re:layers\\.1\\.mlp\\..*"],
        other_lr=0.002,
    )
    groups = groups_by_class(opt)
    assert groups["output"]["algorithm"] == "muon"
    assert groups["embedding"]["lr"] == 0.01 and groups["embedding"]["wd"] == 0.0
    assert groups["matrix"]["wd"] == 0.05 and groups["matrix"]["lr"] == cfg.optimizer.lr
    other = groups["layers.1.mlp.w1.weight"]
    assert other["param_names"] == [f"layers.1.mlp.w{i}.weight" for i in (1, 2, 3)]
    assert other["algorithm"] == "adamw" and other["lr"] == 0.002
    assert not any(n.startswith("layers.1.mlp.") for n in groups["matrix"]["param_names"])


def test_normuon_options(cfg, model) -> None:
    """The section's NorMuon keys: the default for every Muon class, a per-class override."""
    opt = build(
        cfg,
        model,
        normalization="normuon",
        normuon_rescale="rms",
        output_algorithm="muon",
        output_normalization="none",
    )
    groups = groups_by_class(opt)
    assert groups["matrix"]["normalization"] == "normuon"
    assert groups["matrix"]["normuon_rescale"] == "rms"
    assert groups["output"]["algorithm"] == "muon" and groups["output"]["normalization"] == "none"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"normuon_beta2": 1.0}, "optimizer.normuon_beta2: invalid value 1.0"),
        ({"ns_stepz": 3}, "optimizer.ns_stepz: unknown option; did you mean optimizer.ns_steps?"),
        ({"ns_steps": 0}, "optimizer.ns_steps: invalid value 0"),
        ({"betas": [0.9]}, "optimizer.betas: invalid value [0.9]"),
        ({"betas": [0.9, 1.5]}, "optimizer.betas[1]: invalid value 1.5"),
        ({"lr": -1.0}, "optimizer.lr: invalid value -1.0"),
        ({"fused": "yes"}, "optimizer.fused: invalid value 'yes'"),
        ({"orthogonalization": "svd"}, "optimizer.orthogonalization: invalid value 'svd'"),
        ({"matrix_patterns": ["nothing.*"]}, "optimizer.matrix_patterns: pattern 'nothing.*'"),
        ({"norm_algorithm": "muon"}, "optimizer.norm_algorithm: 'muon' but class 'norm'"),
        (
            {"embedding_patterns": ["output.*"], "output_patterns": ["output.weight"]},
            "optimizer.embedding_patterns: parameter 'output.weight' is matched by patterns of "
            "several classes: embedding_patterns, output_patterns",
        ),
    ],
)
def test_errors_name_the_yaml_key(cfg, model, overrides, message) -> None:
    with pytest.raises(TorchtuneConfigError) as info:
        build(cfg, model, **overrides)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_stock_recipes_unnamed_parameters_are_refused(cfg, model) -> None:
    # torchtune's own recipes: config.instantiate(cfg.optimizer, model.parameters()), and one
    # optimizer per parameter ([param]) with optimizer_in_bwd.
    for params in (model.parameters(), [next(model.parameters())]):
        with pytest.raises(TorchtuneConfigError) as info:
            config.instantiate(cfg.optimizer, params)
        text = str(info.value)
        assert text.startswith("optimizer._component_: muon_plugin.torchtune.muon needs (name,")
        assert "muon_plugin/torchtune/full_finetune.py" in text


def test_optimizer_in_bwd_is_refused_naming_the_key() -> None:
    check_recipe_config({"optimizer_in_bwd": False})
    with pytest.raises(TorchtuneConfigError, match=r"^optimizer_in_bwd: True is not supported"):
        check_recipe_config({"optimizer_in_bwd": True})


def test_docs_yaml_example_is_the_config(cfg, model) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.S)
    sections = [OmegaConf.create(b) for b in blocks]
    optimizer = next(s.optimizer for s in sections if "optimizer" in s)
    assert OmegaConf.to_container(optimizer) == OmegaConf.to_container(cfg.optimizer)


def test_turbo_muon_reaches_the_muon_groups(cfg, model) -> None:
    groups = groups_by_class(build(cfg, model, orthogonalization="turbo_muon", ns_steps=4))
    assert groups["matrix"]["orthogonalization_strategy"] == "turbo_muon"
    assert groups["matrix"]["ns_steps"] == 4
