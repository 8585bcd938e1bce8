"""The torchtitan 0.3 adapter (muon_plugin.torchtitan03), in the torchtitan 0.3 environment."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def llama3_debug() -> torch.nn.Module:
    """torchtitan 0.3's llama3 debug model on the CPU, initialized as the Trainer does."""
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_weights()
    return model


def muon_config(**kw):
    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    return MuonOptimizersContainer.Config(lr=1e-2, weight_decay=0.1, **kw)


def test_container_groups_and_checkpoint_contract() -> None:
    """One optimizer, groups with param_names; torchtitan 0.3's init step (zero grads, lr 0)
    leaves the parameters unchanged although weight decay and momentum are on; state keys are
    flattened ``state.{fqn}.{key}`` and load back."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    model = llama3_debug()
    opt = muon_config(muon_toml=str(ROOT / "configs" / "llama3_debug_muon.toml")).build(
        model_parts=[model]
    )
    assert len(opt.optimizers) == 1 and type(opt.optimizers[0]).__name__ == "MuonForeach"
    by = dict(zip(opt.group_classes[0], opt.optimizers[0].param_groups, strict=True))
    assert set(by) == {"matrix", "embedding", "output", "norm"}
    assert by["norm"]["wd"] == 0.0 and by["matrix"]["wd"] == 0.1  # norm_weight_decay from TOML
    names = [n for g in opt.optimizers[0].param_groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "layers.0.attention.qkv_linear.wqkv.weight" in by["matrix"]["param_names"]

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = opt.state_dict()  # runs init_optim_state: zero grads, lr 0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"init step changed {n}"
    assert all(p.grad is None for p in model.parameters())
    key = "state.layers.0.attention.wo.weight.momentum_buffer"
    assert key in sd and torch.count_nonzero(sd[key]) == 0
    assert sd["param_groups.norm.weight.wd"] == 0.0

    # a real step moves every parameter, and the state round-trips through the flat dict
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=opt, training_steps=10
    )
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    schedulers.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}
    other = muon_config(muon_toml=str(ROOT / "configs" / "llama3_debug_muon.toml")).build(
        model_parts=[llama3_debug()]
    )
    other.load_state_dict(sd)
    got = other.state_dict()
    state_keys = {k for k in sd if k.startswith("state.")}
    assert state_keys == {k for k in got if k.startswith("state.")} and len(state_keys) > 45
    assert torch.equal(got[key], sd[key]) and torch.count_nonzero(got[key]) > 0


def test_normuon_state_in_the_checkpoint_contract() -> None:
    """With NorMuon, 0.3's init step creates the per-row second moments (zero) under flattened
    ``state.{fqn}.normuon_second_moment`` keys, one entry per row; they round-trip."""
    from muon_plugin.param_groups.options import MuonConfig

    def build():
        muon = MuonConfig(normalization="normuon")
        return muon_config(muon=muon).build(model_parts=[llama3_debug()])

    opt = build()
    sd = opt.state_dict()  # init_optim_state: zero grads, lr 0
    key = "state.layers.0.attention.wo.weight.normuon_second_moment"
    wo = dict(llama3_debug().named_parameters())["layers.0.attention.wo.weight"]
    assert tuple(sd[key].shape) == (wo.shape[0],) and torch.count_nonzero(sd[key]) == 0
    assert sd["param_groups.layers.0.attention.wo.weight.normalization"] == "normuon"
    for p in opt.optimizers[0].param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}
    assert torch.count_nonzero(sd[key]) == wo.shape[0]
    other = build()
    other.load_state_dict(sd)
    assert torch.equal(other.state_dict()[key], sd[key])


def test_config_refuses_param_groups_and_bad_options() -> None:
    from torchtitan.components.optimizer import ParamGroupConfig

    with pytest.raises(ValueError, match="optimizer.param_groups"):
        muon_config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")])
    bad = muon_config(muon_toml=str(HERE / "missing.toml"))
    with pytest.raises(ValueError, match="optimizer.muon_toml: file not found"):
        bad.build(model_parts=[llama3_debug()])


def test_toml_table_fills_defaults_and_names_unknown_keys(tmp_path: Path) -> None:
    from muon_plugin.param_groups.options import MuonConfig
    from muon_plugin.param_groups.table import apply_table, read_muon_table

    f = tmp_path / "m.toml"
    f.write_text("[optimizer.muon]\nns_steps = 7\nmomentum = 0.9\n")
    got = apply_table(MuonConfig(momentum=0.8), read_muon_table(f))
    assert got.ns_steps == 7 and got.momentum == 0.8  # a value set in Python/CLI wins
    with pytest.raises(ValueError, match=r"optimizer\.muon\.ns_step: unknown option"):
        apply_table(MuonConfig(), {"ns_step": 3})
    f.write_text("[optimizer]\nlr = 1.0\n")
    with pytest.raises(ValueError, match=r"has no \[optimizer.muon\] table"):
        read_muon_table(f)


def test_override_swaps_a_shipped_config() -> None:
    """``--override.imports 'muon_plugin.torchtitan03.override.muon={...}'`` on llama3's own
    debug config: the AdamW catch-all group's lr / wd / betas / eps become the base values."""
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    config = llama3_debugmodel()
    target = "muon_plugin.torchtitan03.override.muon"
    apply_overrides(OverrideConfig(imports=[(target, {"ns_steps": 7, "eps": 1e-7})]), config)
    opt = config.optimizer
    assert type(opt) is MuonOptimizersContainer.Config
    assert (opt.lr, opt.weight_decay, opt.beta1, opt.beta2) == (8e-4, 0.1, 0.9, 0.95)
    assert opt.eps == 1e-7 and opt.muon.ns_steps == 7 and opt.param_groups == []

    from muon_plugin.torchtitan03.override import to_muon

    with pytest.raises(ValueError, match="unknown option 'nssteps'"):
        to_muon(llama3_debugmodel().optimizer, nssteps=3)


def test_every_muon_option_is_a_cli_flag(monkeypatch, capsys) -> None:
    from torchtitan.config import ConfigManager

    from muon_plugin.param_groups.options import MUON_CONFIG_KEYS

    args = ["--module", "muon_plugin.torchtitan03.configs", "--config", "llama3.llama3_debugmodel"]
    config = ConfigManager().parse_args(
        [*args, "--optimizer.muon.ns_steps", "7", "--optimizer.muon.no-nesterov",
         "--optimizer.muon.norm_patterns", "a.*,b.*", "--optimizer.lr", "0.02"]
    )  # fmt: skip
    opt = config.optimizer
    assert opt.muon.ns_steps == 7 and opt.muon.nesterov is False and opt.lr == 0.02
    assert opt.muon.norm_patterns == ["a.*", "b.*"]
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        ConfigManager().parse_args([*args, "--help"])
    help_text = capsys.readouterr().out
    flags = help_text.replace("-", "_")
    missing = [k for k in MUON_CONFIG_KEYS if not re.search(rf"__optimizer\.muon\.{k}\b", flags)]
    assert not missing, missing
    assert "Number of orthogonalization iterations." in help_text  # the schema's docstrings
    # the per-class options' help, generated from one table, reaches --help too
    assert "Learning rate of the 'matrix' class" in " ".join(help_text.split())


def test_importing_changes_nothing_until_activated() -> None:
    probe = textwrap.dedent(
        """
        import torch.nn.attention.flex_attention as flex
        import torchtitan.trainer
        import torchtitan.tools.utils as u
        import torchtitan.distributed.utils as d
        from torchtitan.models.common import attention
        before = (u.device_type, d.set_pg_timeouts, flex._validate_device,
                  attention.FlexAttention._compiled_flex_attn,
                  attention._compiled_create_block_mask)
        import muon_plugin.torchtitan, muon_plugin.torchtitan.cpu_mode
        import muon_plugin.torchtitan03, muon_plugin.torchtitan03.container
        import muon_plugin.torchtitan03.configs, muon_plugin.torchtitan03.cpu_mode
        import muon_plugin.torchtitan03.override, muon_plugin.torchtitan03.train
        after = (u.device_type, d.set_pg_timeouts, flex._validate_device,
                 attention.FlexAttention._compiled_flex_attn,
                 attention._compiled_create_block_mask)
        assert after == before, (before, after)
        assert muon_plugin.torchtitan03.activate() is True
        assert u.device_type == d.device_type == "cpu"
        assert flex._validate_device is not before[2]
        assert attention.FlexAttention._compiled_flex_attn is not before[3]
        assert attention._compiled_create_block_mask is flex.create_block_mask  # eager masks
        print("OK")
        """
    )
    if torch.cuda.is_available():
        pytest.skip("the CPU mode applies only without an accelerator")
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def _python_022() -> str | None:
    """The torchtitan 0.2.2 environment's python (MUON_PLUGIN_PYTHON_022, else ./.venv)."""
    py = os.environ.get("MUON_PLUGIN_PYTHON_022") or str(ROOT / ".venv" / "bin" / "python")
    return py if Path(py).exists() else None


def test_one_toml_gives_the_same_groups_on_both_releases(capsys) -> None:
    """tests/titan03/same_groups.toml through each release's adapter: identical groups (names,
    classes, algorithms, lr, weight decay, every hyperparameter). This release's in this
    process, torchtitan 0.2.2's in its own environment."""
    py022 = _python_022()
    if py022 is None:
        pytest.skip("no torchtitan 0.2.2 environment (./.venv or MUON_PLUGIN_PYTHON_022)")
    toml = str(HERE / "same_groups.toml")
    sys.path.insert(0, str(HERE))
    from groups_dump import main as dump_groups

    dump_groups(toml)
    out = {"0.3": next(x for x in capsys.readouterr().out.splitlines() if x.startswith("GROUPS"))}
    proc = subprocess.run(
        [py022, str(HERE / "groups_dump.py"), toml], capture_output=True, text=True,
        cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["0.2.2"] = next(x for x in proc.stdout.splitlines() if x.startswith("GROUPS"))
    assert '"class": "router"' in out["0.3"] and '"algorithm": "adam"' in out["0.3"]
    assert out["0.3"] == out["0.2.2"]


def test_to_muon_keeps_a_muon_config() -> None:
    from muon_plugin.torchtitan03.override import to_muon

    cfg = muon_config()
    got = to_muon(cfg, momentum=0.9, lr=0.5)
    assert got.lr == 0.5 and got.muon.momentum == 0.9 and cfg.muon.momentum == 0.95
    assert dataclasses.replace(got, lr=1e-2, muon=cfg.muon) == cfg


def test_turbo_muon_from_the_cli() -> None:
    from torchtitan.config import ConfigManager

    args = ["--module", "muon_plugin.torchtitan03.configs", "--config", "llama3.llama3_debugmodel"]
    flags = ["--optimizer.muon.orthogonalization", "turbo_muon", "--optimizer.muon.ns_steps", "4"]
    muon = ConfigManager().parse_args([*args, *flags]).optimizer.muon
    assert (muon.orthogonalization, muon.ns_steps) == ("turbo_muon", 4)
