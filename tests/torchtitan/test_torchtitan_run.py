"""scripts/train.sh end to end (1 process, debug model, a few steps): a config typo is one line
before torchrun starts, the run log lands in the dump folder with the summary, a resume applies
changed settings, and switching optimizers on resume works with the flag (that it is needed:
test_torchtitan_resume.py).

Marked slow (each torchrun starts in ~10 s on 2 CPU cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "llama3_debug_muon.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux", reason="torchrun + gloo runs are exercised on Linux"
    ),
]


def train_sh(
    args: list[str], tmp: Path, data: Path | None = None, data_dir: Path | None = None
) -> subprocess.CompletedProcess:
    """``train.sh CONFIG ARGS``, reading ``data`` (a built corpus); ``DATA_DIR``: ``data_dir``,
    else ``data``."""
    env = dict(os.environ)
    env.update(
        PYTHON=sys.executable,
        NPROC="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf_cache"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("OMP_NUM_THREADS", None)
    if data is not None:
        env["DATA_DIR"] = str(data_dir or data)
        args = [
            "--model.hf_assets_path", str(data / "tokenizer"),
            "--training.dataset_path", str(data / "corpus"),
            "--metrics.disable_color_printing", *args,
        ]  # fmt: skip
    cmd = ["bash", "scripts/train.sh", str(CONFIG), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_typo_fails_in_one_line_before_torchrun(tmp_path: Path) -> None:
    proc = train_sh(["--optimizer.muon.ns_stepz", "7"], tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "config error: optimizer.muon.ns_stepz: unknown key (command line "
        "--optimizer.muon.ns_stepz); did you mean optimizer.muon.ns_steps?"
    ]


def test_log_summary_resume_and_optimizer_switch(assets: Path, tmp_path: Path) -> None:
    dump = tmp_path / "run"
    ckpt = ["--job.dump_folder", str(dump), "--checkpoint.enable", "--checkpoint.interval", "2"]
    first = train_sh([*ckpt, "--training.steps", "2"], tmp_path, assets)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    lines = first.stdout.splitlines()
    assert lines[0].startswith(f"train.sh: log: {dump}/logs/") and lines[-1] == lines[0]
    assert lines[1:3] == [
        f"[train] data: scripts/prepare_data.py --out {assets}",
        f"[prepare_data] {assets} is up to date: corpus sha256 "
        + json.loads((assets / "manifest.json").read_text())["corpus_sha256"][:16]
        + " (from torch 2.13.0, torchtitan 0.2.2)",
    ]
    log_file = Path(lines[0].split()[2])
    text = log_file.read_text()
    assert "Run summary: 2 logged steps (1-2)" in text
    assert "loss: final " in text and "tokens/s over all ranks" in text
    assert f"checkpoints: {dump}/checkpoint (step-2)" in text
    ranks = list((log_file.parent / "ranks").rglob("stdout.log"))
    assert ranks and "Run summary" in ranks[0].read_text()

    changed = ["--optimizer.muon.ns_steps", "7", "--optimizer.muon.norm_weight_decay", "0.05"]
    unread = tmp_path / "unread"  # DATA_DIR, which this job does not read: left alone
    resumed = train_sh([*ckpt, "--training.steps", "3", *changed], tmp_path, assets, unread)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert resumed.stdout.splitlines()[1] == (
        f"[train] data: the job reads nothing in {unread}, so scripts/prepare_data.py is not run"
    )
    assert not unread.exists()
    assert "ns_steps: 5 (checkpoint) -> 7 (job) in matrix" in resumed.stdout
    assert "Muon param groups after loading the checkpoint" in resumed.stdout

    # Without the flag the load is refused (test_torchtitan_resume.py, in one process, with
    # the message); with it, the switch trains on.
    to_adamw = ["--optimizer.name", "AdamW", "--training.steps", "4"]
    exclude = ["--checkpoint.exclude_from_loading", "optimizer,lr_scheduler"]
    switched = train_sh([*ckpt, *to_adamw, *exclude], tmp_path, assets)
    assert switched.returncode == 0, switched.stdout[-4000:]
    assert "Training starts at step 4" in switched.stdout
