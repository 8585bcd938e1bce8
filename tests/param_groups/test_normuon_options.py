"""NorMuon's options: ``[optimizer.muon]`` (torchtitan 0.2.2's TOML and CLI), the per-class
``<class>_normalization``, ``muon_param_groups``, the groups and table the builder makes, and
errors that name the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from muon_plugin import MuonForeach, muon_param_groups
from muon_plugin.adapter import build_job_optimizers
from muon_plugin.param_groups.builder import BaseHyperparams
from muon_plugin.param_groups.options import MuonConfig
from muon_plugin.row_state import ROW_STATE_KEY

BASE = BaseHyperparams(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.wq = nn.Linear(8, 8, bias=False)
        self.experts = nn.Parameter(torch.randn(2, 12, 8))
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 16, bias=False)


def by_class(built) -> dict[str, dict]:
    opt = built.optimizers[0]
    return dict(zip(built.group_classes[0], opt.param_groups, strict=True))


def test_normalization_reaches_every_muon_class_and_the_table():
    cfg = MuonConfig(normalization="normuon", normuon_beta2=0.9, normuon_rescale="rms")
    built = build_job_optimizers([Tiny()], cfg, BASE)
    groups = by_class(built)
    assert {c: g["normalization"] for c, g in groups.items() if g["algorithm"] == "muon"} == {
        "matrix": "normuon",
        "expert": "normuon",
    }
    assert groups["matrix"]["normuon_beta2"] == 0.9
    assert groups["expert"]["normuon_rescale"] == "rms"
    summary = built.format_build_summary()
    assert "matrix     normuon" in summary and "embedding  adamw" in summary, summary


def test_per_class_normalization_overrides_the_default():
    cfg = MuonConfig(expert_normalization="normuon", output_algorithm="muon")
    built = build_job_optimizers([Tiny()], cfg, BASE)
    groups = by_class(built)
    assert groups["expert"]["normalization"] == "normuon"
    assert groups["matrix"]["normalization"] == "none"
    assert groups["output"]["normalization"] == "none"
    model = Tiny()
    opt = MuonForeach(muon_param_groups(model, lr=1e-3, expert_normalization="normuon"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert ROW_STATE_KEY in opt.state[model.experts]
    assert ROW_STATE_KEY not in opt.state[model.wq.weight]
    assert tuple(opt.state[model.experts][ROW_STATE_KEY].shape) == (2, 12)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"normalization": "dion"}, r"optimizer\.muon\.normalization: invalid value 'dion'"),
        ({"normuon_beta2": 1.0}, r"optimizer\.muon\.normuon_beta2: invalid value 1\.0"),
        ({"normuon_eps": -1e-8}, r"optimizer\.muon\.normuon_eps: invalid value -1e-08"),
        ({"normuon_rescale": "paper"}, r"optimizer\.muon\.normuon_rescale: invalid value"),
        (
            {"matrix_normalization": "nor"},
            r"optimizer\.muon\.matrix_normalization: invalid value 'nor'",
        ),
        (
            {"norm_normalization": "normuon"},
            r"optimizer\.muon\.norm_normalization: 'normuon' but norm_algorithm is 'adamw'",
        ),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        MuonConfig(**options)


def test_muon_param_groups_refuses_normalization_of_an_adamw_class():
    with pytest.raises(ValueError, match=r"^embedding_normalization: 'normuon' but"):
        muon_param_groups(Tiny(), lr=1e-3, embedding_normalization="normuon")


def test_torchtitan_toml_and_cli(tmp_path: Path, capsys):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    toml = tmp_path / "job.toml"
    toml.write_text(
        textwrap.dedent(
            """
            [job]
            custom_config_module = "muon_plugin.torchtitan"
            [optimizer]
            name = "muon"
            [optimizer.muon]
            normalization = "normuon"
            expert_normalization = "none"
            """
        )
    )
    cfg = ConfigManager().parse_args(
        ["--job.config_file", str(toml), "--optimizer.muon.normuon_beta2", "0.9"]
    )
    m = cfg.optimizer.muon
    assert (m.normalization, m.expert_normalization, m.normuon_beta2) == ("normuon", "none", 0.9)
    assert m.normuon_eps == 1e-8 and m.normuon_rescale == "frobenius"
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(
            ["--job.config_file", str(toml), "--optimizer.muon.normuon_beta2", "1.5"]
        )
    assert "optimizer.muon.normuon_beta2: invalid value" in capsys.readouterr().err


def test_a_resumed_job_switches_to_normuon_and_starts_its_second_moments_at_zero():
    """Through the adapter core the job's settings win on a load: a Muon checkpoint resumed
    by a NorMuon job keeps its momentum and runs NorMuon from zero second moments."""
    import logging

    from muon_plugin.adapter import keep_job_settings_on_load

    torch.manual_seed(0)
    model = Tiny()
    muon = build_job_optimizers([model], MuonConfig(), BASE)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    muon.optimizers[0].step()
    job = build_job_optimizers([model], MuonConfig(normalization="normuon"), BASE)
    keep_job_settings_on_load(job, lr_from="checkpoint", log=logging.getLogger("test"))
    opt = job.optimizers[0]
    opt.load_state_dict(muon.optimizers[0].state_dict())
    assert "normalization: 'none' (checkpoint) -> 'normuon' (job)" in " ".join(job.changes_on_load)
    assert by_class(job)["matrix"]["normalization"] == "normuon"
    opt.step()
    assert ROW_STATE_KEY in opt.state[model.wq.weight]


def test_a_muon_dcp_checkpoint_under_a_normuon_job_is_named_by_its_missing_key():
    """torchtitan's DCP loader needs every key the job's state has: resuming a Muon checkpoint
    with NorMuon switched on is refused with the missing state name (the way out: start the
    optimizer state afresh), not deep inside torch.distributed.checkpoint."""
    from muon_plugin.adapter.foreign_state import foreign_flat_state

    expected = ["state.wq.weight.momentum_buffer", f"state.wq.weight.{ROW_STATE_KEY}"]
    found = foreign_flat_state(expected, ["state.wq.weight.momentum_buffer"], ["wq.weight"])
    assert found == ("wq.weight", {"momentum_buffer", ROW_STATE_KEY}, {"momentum_buffer"})
