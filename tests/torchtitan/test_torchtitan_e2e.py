"""End-to-end torchtitan runs with optimizer.name = "muon": 2 processes (torchrun), gloo on CPU.

- the debug config trains (loss falls), validates on the held-out split of the local corpus,
  logs the Muon/AdamW groups and the plan, and writes train.sh's run log with the end-of-run
  summary; its last checkpoint (FSDP 2) resumes in 1 process with changed Muon options, which
  win and are logged, then switches to AdamW with the optimizer's state left out;
- a checkpoint saved under FSDP=2 resumes under TP=2 and under FSDP 2 x TP 2 (4 processes) with
  the losses of the uninterrupted run that saved it; these runs use NorMuon
  (``normalization = "normuon"``), so the per-row second moments are resharded too (row shards
  to TP's copies of a column-sharded matrix's rows);
- 2 pipeline stages train, each block compiled as torchtitan compiles it (``fullgraph=True``),
  with QK-Clip recorded inside the compiled graphs;
- QK-Clip (``optimizer.muon.qk_clip_tau`` at a tau the debug models exceed from the first
  steps) is on in every run: the main run and the deepseek_v3 (MLA) run log the heads they clip,
  each at most tau x 1.5 at the next step (``tests/support/qk_clip_log.py`` says why 1.5); the
  resumed runs (TP, FSDP x TP) match the uninterrupted one with it; the first pipeline stage
  clips its own layers.

Marked slow; run by default. The README's commands (the main job, the deepseek_v3 one) run as a
user runs them, ``bash scripts/train.sh``; the other runs start their workers as torchrun does,
forked from a server that imported torch once (``tests/support/trainer_launch.py``: about 8 s
of imports per worker fewer on 2 cores), as does the switch to AdamW. Eight runs in all (the
README's two commands, the resume and the switch, the FSDP 2 run and its two resumes, the
pipeline run): each checks as much as it can.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qk_clip_log import check_clipping, clip_lines
from sample_corpus import exact_chunks, write_corpus
from trainer_launch import run_workers

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "llama3_debug_muon.toml"
TAU = 0.7  # QK-Clip's tau: the llama3 and deepseek_v3 debug models exceed it from step 1-5
QK_CLIP = ["--optimizer.muon.qk_clip_tau", str(TAU)]
LOSS_RE = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([0-9.]+)")  # training steps

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux", reason="torchrun + gloo runs are exercised on Linux"
    ),
]


def titan_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf_cache"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def finish(returncode: int, output: str) -> str:
    out = re.sub(r"^\[rank\d+\]:", "", output, flags=re.M)
    if returncode != 0:
        pytest.fail(f"the run failed (rc={returncode}):\n{out[-6000:]}")
    return out


def main_command(
    args: list[str],
    tmp: Path,
    data: Path,
    timeout: int = 400,
    config: Path = CONFIG,
    nproc: int = 2,
) -> tuple[subprocess.CompletedProcess, str]:
    """The README's main command, ``bash scripts/train.sh CONFIG ...``, on ``nproc`` CPU
    processes (2 unless given), ``DATA_DIR`` ``data``; the finished run (a failed one fails
    the test) and its output (stdout and stderr, rank prefixes removed)."""
    env = titan_env(tmp)
    env.update(NPROC=str(nproc), DATA_DIR=str(data), LOG_RANK="0")
    env.pop("PYTHON", None)
    cmd = ["bash", "scripts/train.sh", str(config), "--metrics.disable_color_printing", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, finish(proc.returncode, proc.stdout + proc.stderr)


def run_titan(
    args: list[str], tmp: Path, nproc: int = 2, timeout: int = 300, log_rank: int | str = 0
) -> str:
    """``torchrun -m torchtitan.train`` with the debug config (the workers forked from the
    preloaded server, :mod:`trainer_launch`); returns the output of ``log_rank`` (a rank, or
    ranks as ``"0,1"``)."""
    argv = ["--job.config_file", str(CONFIG), "--metrics.disable_color_printing", *args]
    run = run_workers("torchtitan.train", argv, nproc, titan_env(tmp), ROOT, timeout)
    return finish(run.returncode, run.output(str(log_rank)))


def losses(log: str) -> dict[int, float]:
    found: dict[int, float] = {}
    for step, loss in LOSS_RE.findall(log):
        found.setdefault(int(step), float(loss))
    return found


def local_run_args(assets: Path, dump_folder: Path, steps: int) -> list[str]:
    """Arguments of a run on the prepared corpus and tokenizer, writing under ``dump_folder``."""
    return [
        "--model.hf_assets_path",
        str(assets / "tokenizer"),
        "--training.dataset_path",
        str(assets / "corpus"),
        "--job.dump_folder",
        str(dump_folder),
        "--training.steps",
        str(steps),
    ]


VALIDATION = [
    "--validation.enable",
    "--validation.dataset",
    "c4_test",
    "--validation.freq",
    "6",
    "--validation.steps",
    "2",
    "--validation.local_batch_size",
    "2",
    "--validation.seq_len",
    "256",
]


MAIN_STEPS = 12


@pytest.fixture(scope="module")
def main_run(assets: Path, tmp_path_factory) -> tuple[subprocess.CompletedProcess, str, Path]:
    """``bash scripts/train.sh configs/llama3_debug_muon.toml`` (the README's main job) for
    MAIN_STEPS steps, with torchtitan's validator on the corpus's held-out split, QK-Clip and
    checkpoints (steps 6 and 12); the run, its output and its dump folder."""
    tmp = tmp_path_factory.mktemp("main_run")
    dump = tmp / "out"
    args = local_run_args(assets, dump, MAIN_STEPS) + VALIDATION + QK_CLIP
    args += ["--validation.dataset_path", str(assets / "corpus_val")]
    args += ["--checkpoint.enable", "--checkpoint.interval", "6"]
    proc, log = main_command(args, tmp, assets)
    return proc, log, dump


def test_main_command_trains_with_muon(main_run, assets: Path) -> None:
    """The README's main job trains, validates, logs its groups, plan and clips, and writes its
    log with the end-of-run summary where train.sh says."""
    proc, log, dump = main_run
    steps = MAIN_STEPS
    got = losses(log)
    assert re.search(r"validate step:\s*6\s+loss:\s*[0-9.]+", log), log[-3000:]
    assert sorted(got) == list(range(1, steps + 1)), log[-3000:]
    first = sum(got[s] for s in (1, 2, 3)) / 3
    last = sum(got[s] for s in range(steps - 4, steps + 1)) / 5
    assert last < first - 1.0, f"loss did not fall clearly: {got}"
    # the param-group table (rank 0) shows both algorithms
    assert "Muon optimizer: MuonForeach" in log
    assert re.search(r"^\s*matrix\s+muon\s+42\s", log, re.M), log[-3000:]
    assert re.search(r"^\s*embedding\s+adamw\s+1\s", log, re.M)
    assert re.search(r"^\s*output\s+adamw\s+1\s", log, re.M)
    assert re.search(r"^\s*norm\s+adamw\s+13\s.*\s0$", log, re.M)  # norm_weight_decay = 0
    assert "Muon orthogonalization plan" in log
    assert "CPU" in log  # torchtitan ran on the CPU stand-in device
    # QK-Clip: the settings in the build summary, every attention layer, the heads it clipped
    assert f"qk-clip tau {TAU:g} alpha 0.5 gqa query" in log
    assert "QK-Clip: tau 0.7, alpha 0.5; 6 attention layers (multi-head), 96 query heads" in log
    lines = check_clipping(log, TAU)
    assert len(lines) == steps  # one per logged training step (validation steps add none)

    # train.sh's own lines, and the log it writes (every rank's files beside it)
    out = proc.stdout.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("train.sh: log: "))
    assert all(line.startswith(("[train] environment", "[setup_env]")) for line in out[:first])
    out = out[first:]
    assert out[0].startswith(f"train.sh: log: {dump}/logs/") and out[-1] == out[0]
    assert out[1:3] == [
        f"[train] data: scripts/prepare_data.py --out {assets}",
        f"[prepare_data] {assets} is up to date: corpus sha256 "
        + json.loads((assets / "manifest.json").read_text())["corpus_sha256"][:16]
        + " (from torch 2.13.0, torchtitan 0.2.2)",
    ]
    log_file = Path(out[0].split()[2])
    text = log_file.read_text()
    assert f"Run summary: {steps} logged steps (1-{steps})" in text
    assert "loss: final " in text and "tokens/s over all ranks" in text
    assert f"checkpoints: {dump}/checkpoint (step-6, step-{steps})" in text
    ranks = list((log_file.parent / "ranks").rglob("stdout.log"))
    assert ranks and "Run summary" in ranks[0].read_text()


def test_resume_applies_changed_options_and_switches_optimizers(
    main_run, assets: Path, tmp_path: Path
) -> None:
    """The main job's last checkpoint (FSDP 2) resumed by train.sh in 1 process with changed
    Muon options: the job's settings win and the change is logged (the Muon state resharded
    from 2 ranks to 1; torchtitan's dataloader cannot be, so its state is left out); then,
    with the flag that leaves the optimizer's state out, a switch to AdamW trains on (without
    it the load is refused: test_torchtitan_resume.py, in one process, with the message)."""
    _, _, dump = main_run
    job = ["--checkpoint.enable", *QK_CLIP]
    changed = ["--optimizer.muon.ns_steps", "7", "--optimizer.muon.norm_weight_decay", "0.05"]
    no_data = ["--checkpoint.exclude_from_loading", "dataloader"]
    unread = tmp_path / "unread"  # DATA_DIR, which this job does not read: left alone
    args = local_run_args(assets, dump, MAIN_STEPS + 1) + job + changed + no_data
    resumed, out = main_command(args, tmp_path, unread, nproc=1)
    assert (
        f"[train] data: the job reads nothing in {unread}, so scripts/prepare_data.py is not run"
    ) in resumed.stdout.splitlines()
    assert not unread.exists()
    assert "ns_steps: 5 (checkpoint) -> 7 (job) in matrix" in out
    assert "Muon param groups after loading the checkpoint" in out
    assert f"Training starts at step {MAIN_STEPS + 1}" in out

    to_adamw = ["--optimizer.name", "AdamW"]
    exclude = ["--checkpoint.exclude_from_loading", "optimizer,lr_scheduler,dataloader"]
    args = local_run_args(assets, dump, MAIN_STEPS + 2) + job + to_adamw + exclude
    switched = run_titan(args, tmp_path, nproc=1)
    assert f"Training starts at step {MAIN_STEPS + 2}" in switched


TOTAL, SPLIT, BATCH = 8, 4, 2
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
# layout: (processes, data-parallel ranks, arguments)
LAYOUTS = {
    "tp2": (
        2,
        1,
        [
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    ),
    # FSDP 2 x TP 2: _StridedShard + Shard placements in one step
    "fsdp2xtp2": (4, 2, [*FSDP2, "--parallelism.tensor_parallel_degree", "2"]),
}


def _common(assets: Path) -> list[str]:
    return [
        "--optimizer.muon.normalization",
        "normuon",
        "--model.hf_assets_path",
        str(assets / "tokenizer"),
        "--lr_scheduler.total_steps",
        str(TOTAL),
        "--training.local_batch_size",
        str(BATCH),
        "--checkpoint.interval",
        "1000",
        *QK_CLIP,
    ]


@pytest.fixture(scope="module")
def fsdp_checkpoint(assets: Path, tmp_path_factory) -> dict:
    """An uninterrupted FSDP=2 run of TOTAL steps that saves a checkpoint at step SPLIT.

    Data: every document is exactly one sample. The FSDP corpus is a list D repeated twice, so
    both FSDP ranks (contiguous halves) read D and the global batch is two copies of the batch
    a single data-parallel rank reads from D. torchtitan cannot reshard the dataloader state
    (dp 2 -> 1), so resumed runs skip it and read D without the SPLIT * BATCH documents the
    first steps consumed (repeated once per data-parallel rank).
    """
    tmp = tmp_path_factory.mktemp("titan_ckpt")
    docs = exact_chunks(assets, 24)
    corpus = write_corpus(tmp / "corpus_fsdp", docs + docs)
    ref_log = run_titan(
        _common(assets)
        + FSDP2
        + [
            "--training.dataset_path",
            str(corpus),
            "--training.steps",
            str(TOTAL),
            "--job.dump_folder",
            str(tmp / "ref"),
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(SPLIT),
        ],
        tmp,
    )
    ckpt = tmp / "ref" / "checkpoint" / f"step-{SPLIT}"
    assert ckpt.is_dir(), sorted(p.name for p in ckpt.parent.iterdir())
    return {"ref": losses(ref_log), "checkpoint": ckpt, "docs": docs}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_from_fsdp2_resumes(
    layout: str, assets: Path, fsdp_checkpoint: dict, tmp_path: Path
) -> None:
    """Saved at step SPLIT under FSDP=2, resumed under ``layout``: the next losses match the
    uninterrupted run (model and Muon/AdamW state resharded from Shard(0) to TP placements,
    or to FSDP x TP's _StridedShard + Shard), QK-Clip on in both (on TP its heads are split
    over the ranks, on FSDP x TP its maxima are reduced over the FSDP ranks)."""
    ref = fsdp_checkpoint["ref"]
    assert sorted(ref) == list(range(1, TOTAL + 1))

    nproc, dp, layout_args = LAYOUTS[layout]
    rest = fsdp_checkpoint["docs"][SPLIT * BATCH :]
    corpus = write_corpus(tmp_path / "corpus", rest * dp)
    saved = tmp_path / "run" / "checkpoint" / fsdp_checkpoint["checkpoint"].name
    shutil.copytree(fsdp_checkpoint["checkpoint"], saved)
    log = run_titan(
        _common(assets)
        + layout_args
        + [
            "--training.dataset_path",
            str(corpus),
            "--training.steps",
            str(TOTAL),
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--checkpoint.enable",
            "--checkpoint.exclude_from_loading",
            "dataloader",
        ],
        tmp_path,
        nproc=nproc,
    )
    second = losses(log)
    print(f"\n{layout}: uninterrupted {ref}\n{layout}: resumed {second}")
    assert f"Training starts at step {SPLIT + 1}" in log, log[-3000:]
    assert sorted(second) == list(range(SPLIT + 1, TOTAL + 1))
    for s in range(SPLIT + 1, TOTAL + 1):
        assert second[s] == pytest.approx(ref[s], abs=2e-3), (s, second, ref)
    # the run learned something (the reference is not flat), so matching it means something;
    # the last batch alone can be a hard one, whatever text the machine's corpus holds
    assert min(ref.values()) < ref[1] - 0.5, ref
    clipped = [line.n_clipped for line in clip_lines(log)]
    assert len(clipped) == TOTAL - SPLIT and sum(clipped) > 0, clipped  # they clipped heads too


def test_pipeline_parallel_trains_with_muon(assets: Path, tmp_path: Path) -> None:
    """2 pipeline stages, one optimizer per model part; the last stage logs the loss. Each
    block is compiled (``--compile.enable``: torchtitan's ``fullgraph=True`` per block; the
    aot_eager backend keeps it fast): QK-Clip's recording is traced into the graphs without a
    break, and the first stage (rank 0) clips its own layers' heads."""
    steps = 6
    tau = 0.5  # one data-parallel rank: the first logits are lower than under FSDP=2
    pp2 = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    ]
    compiled = ["--compile.enable", "--compile.backend", "aot_eager"]
    qk_clip = ["--optimizer.muon.qk_clip_tau", str(tau)]
    log = run_titan(
        [*local_run_args(assets, tmp_path / "pp2", steps), *pp2, *compiled, *qk_clip],
        tmp_path,
        nproc=2,
        log_rank="0,1",
    )
    got = losses(log)  # rank 1's: rank 0, not the last stage, logs a loss of -1
    assert sorted(got) == list(range(1, steps + 1)), log[-3000:]
    assert got[steps] < got[1] - 0.5, f"loss did not fall: {got}"
    assert "Compiling each TransformerBlock with torch.compile" in log
    assert "3 attention layers (multi-head), 48 query heads" in log  # rank 0's stage
    check_clipping(log, tau)


def test_deepseek_v3_mla_clips_with_muon(assets: Path, tmp_path: Path) -> None:
    """The deepseek_v3 debug model (MLA attention, MoE) with QK-Clip, one process (its layouts
    are the llama3 runs'): every MLA layer's heads are clipped (no-rope q and k rows, rope
    queries), and stay near tau at the next step."""
    steps = 3
    config = ROOT / "configs" / "deepseek_v3_debug_muon.toml"
    tau = 0.6  # one process: its first logits are lower than under FSDP=2's larger batch
    args = [*local_run_args(assets, tmp_path / "ds", steps), "--optimizer.muon.qk_clip_tau", "0.6"]
    log = main_command(args, tmp_path, assets, config=config, nproc=1)[1]  # the README's command
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1)), log[-3000:]
    assert "6 attention layers (6 MLA), 96 query heads" in log, log[-3000:]
    check_clipping(log, tau)
    # The convergence benchmark's reader of these lines (its QK-Clip curves) reads every step.
    sys.path.insert(0, str(ROOT / "scripts"))
    import qk_clip_curves

    curve = qk_clip_curves.parse(re.sub(r"\x1b\[[0-9;]*m", "", log))
    assert [s for s, _, _ in curve] == list(range(1, steps + 1)), curve
    assert all(n > 0 for _, _, n in curve[:1]) and all(m > 0 for _, m, _ in curve), curve
