"""[optimizer.muon] through torchtitan's ConfigManager: TOML, CLI overrides, --help, errors."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import torchtitan.config as tt_config  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from muon_plugin.torchtitan.config import MUON_CONFIG_KEYS, MuonConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

TOML = """
[job]
custom_config_module = "muon_plugin.torchtitan"

[optimizer]
name = "muon"
lr = 8e-4
weight_decay = 0.1

[optimizer.muon]
orthogonalization = "newton_schulz"
ns_steps = 5
lr_adjust = "keller"
norm_weight_decay = 0.0
embedding_lr = 3e-3
output_patterns = ["output.*"]
"""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def parse(args: list[str]):
    return ConfigManager().parse_args(args)


def test_toml_and_cli_overrides(tmp_path: Path) -> None:
    cfg = parse(
        [
            "--job.config_file",
            write(tmp_path, TOML),
            "--optimizer.muon.ns_steps",
            "7",
            "--optimizer.muon.no-nesterov",
            "--optimizer.muon.embedding_patterns",
            "tok_*,re:foo.*",
            "--optimizer.lr",
            "1e-3",
            "--optimizer.muon.backend",
            "plain",
        ]
    )
    opt = cfg.optimizer
    assert isinstance(opt, tt_config.Optimizer)  # still torchtitan's Optimizer
    assert opt.name == "muon" and opt.lr == 1e-3 and opt.weight_decay == 0.1
    assert isinstance(opt.muon, MuonConfig)
    m = opt.muon
    assert (m.orthogonalization, m.ns_steps, m.nesterov, m.lr_adjust) == (
        "newton_schulz",
        7,
        False,
        "keller",
    )
    assert m.norm_weight_decay == 0.0 and m.embedding_lr == 3e-3
    assert m.output_patterns == ["output.*"]
    assert m.embedding_patterns == ["tok_*", "re:foo.*"]
    # untouched options keep the plugin defaults
    assert m.implementation == "foreach" and m.cautious_weight_decay is True
    assert m.state_dtype == "fp32" and m.momentum == 0.95
    assert m.backend == "plain"


def test_defaults_without_a_muon_section(tmp_path: Path) -> None:
    cfg = parse(
        [
            "--job.config_file",
            write(tmp_path, '[job]\ncustom_config_module = "muon_plugin.torchtitan"\n'),
        ]
    )
    assert cfg.optimizer.name == "AdamW"  # torchtitan's default is unchanged
    assert cfg.optimizer.muon == MuonConfig()
    assert cfg.optimizer.muon.lr_adjust == "match_rms_adamw"


def test_cli_only_custom_module() -> None:
    cfg = parse(
        [
            "--job.custom_config_module",
            "muon_plugin.torchtitan",
            "--optimizer.name",
            "muon",
            "--optimizer.muon.momentum",
            "0.9",
        ]
    )
    assert cfg.optimizer.muon.momentum == 0.9


def test_help_lists_every_option_with_docstrings(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        parse(["--job.custom_config_module", "muon_plugin.torchtitan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key in MUON_CONFIG_KEYS:
        assert f"--optimizer.muon.{key.replace('_', '-')}" in out, key
    assert "Number of orthogonalization iterations" in out
    assert "0.2*sqrt(max(rows, cols))" in out
    assert "Settings of optimizer.name" in out or "Muon optimizer (muon_plugin)" in out
    assert not re.search(r"\(default: [^)]*\)\. \(default:", out)  # one default per option
    assert "unset (None)" in out


def test_unknown_key_in_muon_section(tmp_path: Path) -> None:
    toml = TOML + "ns_stepz = 3\n"
    with pytest.raises(ValueError, match="Invalid field names.*ns_stepz"):
        parse(["--job.config_file", write(tmp_path, toml)])


@pytest.mark.parametrize(
    "line, message",
    [
        ('orthogonalization = "svd"', r"optimizer\.muon\.orthogonalization: invalid value 'svd'"),
        ('lr_adjust = "moonlight"', r"optimizer\.muon\.lr_adjust: invalid value 'moonlight'"),
        ('state_dtype = "int3"', r"optimizer\.muon\.state_dtype: invalid value 'int3'"),
        ('implementation = "fused"', r"optimizer\.muon\.implementation: invalid value 'fused'"),
        ("ns_steps = 0", r"optimizer\.muon\.ns_steps: invalid value 0"),
        ("momentum = 1.5", r"optimizer\.muon\.momentum: invalid value 1\.5"),
        ("block_size = -4", r"optimizer\.muon\.block_size: invalid value -4"),
        ('nesterov = "yes"', r"optimizer\.muon\.nesterov: invalid value 'yes'"),
        ("embedding_lr = -1.0", r"optimizer\.muon\.embedding_lr: invalid value -1\.0"),
        ('router_algorithm = "sgd"', r"optimizer\.muon\.router_algorithm: invalid value 'sgd'"),
        ('norm_patterns = [""]', r"optimizer\.muon\.norm_patterns: empty"),
        ('norm_patterns = "norm*"', r"optimizer\.muon\.norm_patterns: invalid value 'norm\*'"),
        ('backend = "tpu"', r"optimizer\.muon\.backend: invalid value 'tpu'; expected one of"),
        ("qk_clip_tau = 0.0", r"optimizer\.muon\.qk_clip_tau: invalid value 0\.0; expected a"),
        ("qk_clip_alpha = 1.5", r"optimizer\.muon\.qk_clip_alpha: invalid value 1\.5"),
        ('qk_clip_gqa = "all"', r"optimizer\.muon\.qk_clip_gqa: invalid value 'all'"),
    ],
)
def test_bad_values_name_key_and_value(tmp_path: Path, line: str, message: str) -> None:
    toml = TOML.replace("[optimizer.muon]\n", f"[optimizer.muon]\n{line}\n")
    if line.split("=")[0].strip() in TOML:  # replace instead of duplicating the key
        key = line.split("=")[0].strip()
        toml = "\n".join(ln for ln in TOML.splitlines() if not ln.startswith(key + " "))
        toml = toml.replace("[optimizer.muon]", f"[optimizer.muon]\n{line}")
    with pytest.raises(ValueError, match=message):
        parse(["--job.config_file", write(tmp_path, toml)])


def test_bad_cli_choice_exits(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        parse(["--job.config_file", write(tmp_path, TOML), "--optimizer.muon.lr_adjust", "x"])
    assert e.value.code != 0


def test_example_configs_parse() -> None:
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = parse(["--job.config_file", str(path)])
        assert cfg.optimizer.name == "muon", path
        cfg.optimizer.muon.validate()


def test_turbo_muon_from_toml_and_cli(tmp_path: Path) -> None:
    toml = TOML.replace('"newton_schulz"', '"turbo_muon"').replace("ns_steps = 5", "ns_steps = 4")
    m = parse(["--job.config_file", write(tmp_path, toml)]).optimizer.muon
    assert (m.orthogonalization, m.ns_steps) == ("turbo_muon", 4)
    flag = ["--optimizer.muon.orthogonalization", "turbo_muon"]
    m = parse(["--job.config_file", write(tmp_path, TOML), *flag]).optimizer.muon
    assert m.orthogonalization == "turbo_muon"
