"""End-to-end torchtitan 0.3 runs with Muon on CPU processes (gloo), through
``muon_plugin.torchtitan03.train`` (what ``scripts/train.sh`` launches) and
``configs/titan03_muon.py``. The workers start as torchrun starts them, forked from a server
that imported torch once (``tests/support/trainer_launch.py``); ``test_titan03_run.py`` runs
``scripts/train.sh`` itself.

- FSDP=2: trains (loss falls), logs the rule table and the plan; also the reference run;
- a checkpoint saved under FSDP=2 at step SPLIT resumes under TP=2 with the next losses of the
  uninterrupted run (TP=2 training, model and Muon/AdamW state resharded); these runs use
  NorMuon (``normalization = "normuon"``), whose per-row second moments are resharded too;
- FSDP 2 x TP 2 (4 processes) trains;
- 2 pipeline stages (torchtitan 0.3's interleaved schedule, 2 model parts per rank) train, one
  optimizer per model part (what torchtitan 0.3's own DistMuon refuses, like TP);
- the deepseek_v3 debug model (MoE) trains under FSDP=2: expert stacks on Muon, the router on
  AdamW;
- QK-Clip (``optimizer.muon.qk_clip_tau``, a tau the debug models exceed from the first steps)
  is on in every run: the FSDP run (fused ``wqkv``) and the deepseek_v3 run (MLA) log the heads they
  clip, each at most tau x 1.5 at the next step (``tests/support/qk_clip_log.py``); the TP resume
  matches the uninterrupted run with it; FSDP x TP and the pipeline stages clip their heads.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from qk_clip_log import check_clipping, clip_lines
from sample_corpus import exact_chunks, write_corpus
from trainer_launch import run_workers

ROOT = Path(__file__).resolve().parents[2]
TAU = 0.7
QK_CLIP = ["--optimizer.muon.qk_clip_tau", str(TAU)]
LOSS_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")
TOTAL, SPLIT, BATCH = 8, 4, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo runs on Linux"),
]


def run(
    args: list[str],
    tmp: Path,
    nproc: int = 2,
    timeout: int = 300,
    config: str = "llama3_debug_muon",
    ranks: str = "0",
) -> str:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf_cache"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    argv = [
        "--module", "configs.titan03_muon", "--config", config,
        "--metrics.disable_color_printing", *args,
    ]  # fmt: skip
    result = run_workers("muon_plugin.torchtitan03.train", argv, nproc, env, ROOT, timeout)
    out = result.output(ranks)
    if result.returncode != 0:
        pytest.fail(f"the run failed (rc={result.returncode}):\n{out[-6000:]}")
    return out


def losses(log: str) -> dict[int, float]:
    found: dict[int, float] = {}
    for step, loss in LOSS_RE.findall(log):
        found.setdefault(int(step), float(loss))
    return found


def _common(assets: Path, corpus: Path, dump: Path, steps: int, interval: int = 1000) -> list[str]:
    return [
        "--optimizer.muon.normalization", "normuon",
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset_path", str(corpus),
        "--dump_folder", str(dump),
        "--training.steps", str(steps),
        "--training.local_batch_size", str(BATCH),
        "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.total_steps", str(TOTAL),  # the same schedule in the split runs
        "--checkpoint.interval", str(interval),
        *QK_CLIP,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp_runs(assets: Path, tmp_path_factory) -> dict:
    """An uninterrupted FSDP=2 run of TOTAL steps that saves a checkpoint at step SPLIT.

    Every document is one sample; the FSDP corpus is the list D twice, so each FSDP rank
    (a contiguous half) reads D. The dataloader state cannot be resharded (dp 2 -> 1): the
    resumed run skips it and reads D without the first SPLIT * BATCH documents.
    """
    tmp = tmp_path_factory.mktemp("titan03_ckpt")
    docs = exact_chunks(assets, 24)
    corpus = write_corpus(tmp / "corpus_fsdp", docs + docs)
    args = [*_common(assets, corpus, tmp / "ref", TOTAL, interval=SPLIT), "--checkpoint.enable"]
    ref = run(args, tmp)
    ckpt = tmp / "ref" / "checkpoint" / f"step-{SPLIT}"
    assert ckpt.is_dir(), sorted(p.name for p in ckpt.parent.iterdir())
    return {"ref": ref, "checkpoint": ckpt, "docs": docs}


def test_fsdp2_trains_with_normuon(fsdp_runs: dict) -> None:
    log = fsdp_runs["ref"]
    got = losses(log)
    assert sorted(got) == list(range(1, TOTAL + 1)), log[-3000:]
    # the documents differ step to step: the last batch alone can be a hard one
    assert min(got.values()) < got[1] - 0.5, f"loss did not fall: {got}"
    assert "Muon optimizer: MuonForeach" in log
    assert re.search(r"^\s*matrix\s+normuon\s+30\s", log, re.M), log[-3000:]  # wqkv fused
    assert re.search(r"^\s*norm\s+adamw\s+13\s.*\s0$", log, re.M)  # TOML: norm_weight_decay 0
    assert "Muon orthogonalization plan" in log and "(S(0))" in log
    assert "normuon second moments" in log
    assert "QK-Clip: tau 0.7, alpha 0.5; 6 attention layers (multi-head), 96 query heads" in log
    check_clipping(log, TAU)


def test_checkpoint_from_fsdp2_resumes_under_tp2(
    assets: Path, fsdp_runs: dict, tmp_path: Path
) -> None:
    ref = losses(fsdp_runs["ref"])
    corpus = write_corpus(tmp_path / "corpus", fsdp_runs["docs"][SPLIT * BATCH :])
    # Only the step-SPLIT checkpoint: the run also saved its last step, which would be loaded.
    shutil.copytree(fsdp_runs["checkpoint"], tmp_path / "run" / "checkpoint" / f"step-{SPLIT}")
    log = run(
        [
            *_common(assets, corpus, tmp_path / "run", TOTAL),
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--checkpoint.enable",
            "--checkpoint.exclude_from_loading",
            "dataloader",
        ],  # fmt: skip
        tmp_path,
    )
    second = losses(log)
    assert f"Training starts at step {SPLIT + 1}" in log, log[-3000:]
    assert "S(1)" in log  # the plan shows TP placements (row-wise wo / w2)
    assert sorted(second) == list(range(SPLIT + 1, TOTAL + 1))
    for s in range(SPLIT + 1, TOTAL + 1):
        assert second[s] == pytest.approx(ref[s], abs=2e-3), (s, second, ref)
    clipped = [line.n_clipped for line in clip_lines(log)]
    assert len(clipped) == TOTAL - SPLIT and sum(clipped) > 0, clipped


def test_fsdp2_x_tp2_trains_with_muon(assets: Path, tmp_path: Path) -> None:
    steps = 4
    log = run(
        [
            "--hf_assets_path",
            str(assets / "tokenizer"),
            "--dataloader.dataset_path",
            str(assets / "corpus"),
            "--dump_folder",
            str(tmp_path / "out"),
            "--training.steps",
            str(steps),
            "--parallelism.tensor_parallel_degree",
            "2",
            *QK_CLIP,
        ],  # fmt: skip
        tmp_path,
        nproc=4,
    )
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1)), log[-3000:]
    assert got[steps] < got[1] - 0.3, f"loss did not fall: {got}"
    assert "2x2" in log  # the plan's mesh: FSDP 2 x TP 2


def _short_run(assets: Path, tmp_path: Path, steps: int) -> list[str]:
    return [
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset_path", str(assets / "corpus"),
        "--dump_folder", str(tmp_path / "out"),
        "--training.steps", str(steps),
    ]  # fmt: skip


def test_pipeline_parallel_trains_with_muon(assets: Path, tmp_path: Path) -> None:
    """PP=2 with the debug config's interleaved schedule: each rank holds two model parts,
    each with its own Muon optimizer; the last stage (rank 1) logs the loss."""
    steps = 4
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"]
    log = run([*_short_run(assets, tmp_path, steps), *pp, *QK_CLIP], tmp_path, ranks="0,1")
    assert "Using pipeline schedule Interleaved1F1B" in log, log[-3000:]
    got = {s: v for s, v in losses(log).items() if v > 0}  # rank 0 logs -1 (no last stage)
    assert sorted(got) == list(range(1, steps + 1)), log[-3000:]
    assert got[steps] < got[1] - 0.3, f"loss did not fall: {got}"
    # Rank 0 builds stages 0 and 2: one optimizer (and rule table) per model part.
    tables = re.findall(r"^\s*matrix\s+muon\s+(\d+)\s", log, re.M)
    assert len(tables) >= 2, log[-3000:]


def test_moe_experts_train_with_muon(assets: Path, tmp_path: Path) -> None:
    steps = 3
    log = run(
        [*_short_run(assets, tmp_path, steps), *QK_CLIP], tmp_path, config="deepseek_v3_debug_muon"
    )
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1)), log[-3000:]
    assert got[steps] < got[1] - 0.2, f"loss did not fall: {got}"
    assert "attention layers (6 MLA)" in log, log[-3000:]
    check_clipping(log, TAU)
    assert re.search(r"^\s*expert\s+muon\s+\d+\s", log, re.M), log[-3000:]
    assert re.search(r"^\s*router\s+adamw\s+\d+\s", log, re.M), log[-3000:]
