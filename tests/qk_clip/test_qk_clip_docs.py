"""The README's QK-Clip section: its TOML table parses to what it says in a torchtitan 0.2.2
job, and each of its commands is one a test runs (``scripts/train.sh CONFIG`` with the same
``--optimizer.muon.qk_clip_tau``). Its YAML block and its torchtitan 0.3 line are run by the
TorchTune and 0.3 tests (``tests/torchtune/test_torchtune_qk_clip.py``,
``tests/titan03/test_titan03_qk_clip.py``)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from qk_clip_readme import blocks

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]


def test_toml_table_parses_in_a_job(tmp_path: Path) -> None:
    from torchtitan.config import ConfigManager

    (table,) = blocks("toml")
    assert table.startswith("[optimizer.muon]\n")
    job = (ROOT / "configs" / "llama3_debug_muon.toml").read_text()
    job = job.replace("[optimizer.muon]\n", table)
    path = tmp_path / "job.toml"
    path.write_text(job)
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    muon = cfg.optimizer.muon
    assert (muon.qk_clip_tau, muon.qk_clip_alpha, muon.qk_clip_gqa) == (100.0, 0.5, "query")


# the tests that run each README command (train.sh, that config, that flag)
RUN_BY = {
    "configs/llama3_debug_muon.toml": "tests/torchtitan/test_torchtitan_e2e.py",
    "configs/deepseek_v3_debug_muon.toml": "tests/torchtitan/test_torchtitan_e2e.py",
    "configs/titan03_muon.py:llama3_debug_muon": "tests/titan03/test_titan03_run.py",
}


def test_every_command_is_run_by_a_test() -> None:
    (commands,) = blocks("bash")
    lines = [ln for ln in commands.splitlines() if ln.strip()]
    assert len(lines) == len(RUN_BY)
    for line in lines:
        words = shlex.split(line)
        assert (
            words[:2] == ["bash", "scripts/train.sh"] and words[3] == "--optimizer.muon.qk_clip_tau"
        )
        config, tau = words[2], words[4]
        test = (ROOT / RUN_BY[config]).read_text()
        assert "scripts/train.sh" in test and "qk_clip_tau" in test, config
        assert f"TAU = {tau}" in test or f'"--optimizer.muon.qk_clip_tau", "{tau}"' in test
        stem = config.split(":")[0].removeprefix("configs/")
        assert stem.split(".")[0] in test or config in test, config
