"""Tests of the TorchTune integration: collected only where torchtune is installed (its own
environment, ``.venv-torchtune``; ``scripts/test.sh`` runs them there).

Fixtures: ``tt_data`` (a small corpus and tokenizer from ``scripts/prepare_data.py``, built with
the torchtitan 0.2.2 environment's Python, whose pinned packages the corpus is made of) and
``tt_init`` (the random starting checkpoint of the tiny config, written by
``muon_plugin.torchtune.init_checkpoint``).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path

import pytest
from tt_common import CONFIG, ROOT, data_overrides, data_python


def _torchtune_installed() -> bool:
    # The distribution, not find_spec: with tests/ on sys.path, this folder would pass for a
    # namespace package called torchtune.
    try:
        importlib.metadata.distribution("torchtune")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore_glob = [] if _torchtune_installed() else ["test_*.py"]


@pytest.fixture(scope="session")
def tt_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``corpus/data.json`` (about 23 documents) and ``tokenizer/`` (byte-level BPE, 2048)."""
    out = tmp_path_factory.mktemp("tt_data")
    small = ["--max-bytes", "300000", "--tokenizer-bytes", "300000", "-q"]
    subprocess.run(
        [data_python(), str(ROOT / "scripts" / "prepare_data.py"), "--out", str(out), *small],
        check=True,
        cwd=ROOT,
        timeout=300,
    )
    return out


@pytest.fixture(scope="session")
def tt_init(tmp_path_factory: pytest.TempPathFactory, tt_data: Path) -> Path:
    """The folder holding the tiny config's random starting checkpoint (written in-process by
    ``python -m muon_plugin.torchtune.init_checkpoint``'s ``main``)."""
    from muon_plugin.torchtune.init_checkpoint import main

    init = tmp_path_factory.mktemp("tt_init")
    assert main(["--config", str(CONFIG), *data_overrides(tt_data, init)]) == 0
    assert (init / "model-00001-of-00001.bin").is_file()
    return init
