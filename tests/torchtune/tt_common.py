"""Paths and environments shared by the TorchTune tests (no torchtune import: the conftest
that imports this is read in every environment)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "torchtune_llama3_2_muon.yaml"


def data_python() -> str:
    """The Python of the torchtitan 0.2.2 environment (``MUON_PLUGIN_PYTHON_022``, default
    ``./.venv``): ``scripts/prepare_data.py`` builds its corpus from that environment's pins."""
    configured = os.environ.get("MUON_PLUGIN_PYTHON_022")
    python = configured or str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists():
        if configured:
            pytest.fail(f"MUON_PLUGIN_PYTHON_022={configured} does not exist")
        pytest.skip("no torchtitan 0.2.2 environment to build the corpus (scripts/setup_env.sh)")
    return python


def offline_env(tmp: Path) -> dict[str, str]:
    """The environment of a run: no hub, the datasets cache under ``tmp``."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp / "hf_home"),
        HF_DATASETS_CACHE=str(tmp / "hf_datasets"),
    )
    return env


def data_overrides(data: Path, init: Path) -> list[str]:
    """``key=value`` overrides pointing the tiny config at the test's data and checkpoint."""
    return [
        f"tokenizer.path={data / 'tokenizer'}",
        f"dataset.data_files={data / 'corpus' / 'data.json'}",
        f"checkpointer.checkpoint_dir={init}",
    ]
