"""The recipe ``muon_plugin/torchtune/full_finetune.py`` end to end: the tiny llama3_2 config
(``configs/torchtune_llama3_2_muon.yaml``, random start, local corpus) on 2 CPU processes (gloo),
2 epochs of 4 steps, cosine LR schedule; the first run through ``tune run``.

- FSDP=2 trains with Muon on the matrices and AdamW on the embedding, norms and output head:
  rank 0 logs the rule table once and the plan (FSDP ``S(0)`` shards); the loss falls; the
  rank-0 full optimizer state dict of epoch 0 holds every class's state under its name;
- rank 0 logs the end-of-run summary (8 logged steps, the checkpoint folders);
- resuming from that checkpoint (FSDP=2) gives the uninterrupted run's epoch-2 losses exactly;
  resuming with a changed option (``optimizer.ns_steps=1``) logs the change and trains with it;
- TP=2 (torchtune's llama TP plan) with ``enable_async_checkpointing`` (DCP) trains like FSDP
  (same losses to 1e-4: the same global batches and the same whole-matrix orthogonalization),
  and resuming from its DCP checkpoint gives its epoch-2 losses exactly;
- ``optimizer_in_bwd=True`` ends the recipe with one line naming the key, before any process
  group or model;
- QK-Clip (``optimizer.qk_clip_tau``, a tau the tiny model exceeds from step 1) is on in every
  run: the FSDP run logs the heads it clips, each at most tau x 1.5 at the next step
  (``tests/support/qk_clip_log.py``); the resumes and TP (heads split over the ranks) match with it;
  with ``compile=True`` (each layer compiled) the recording is traced and the losses are eager's.

Marked slow (a run takes tens of seconds on 2 CPU cores).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qk_clip_log import check_clipping
from trainer_launch import run_workers
from tt_common import CONFIG, ROOT, data_overrides, offline_env

STEPS, EPOCHS = 4, 2
LOSS_RE = re.compile(r"^Step (\d+) \| loss:([0-9.eE+-]+) ", flags=re.M)
RECIPE = "muon_plugin/torchtune/full_finetune.py"
TAU = 1.0  # QK-Clip's tau: the tiny llama3_2 exceeds it from step 1
TP = [
    "tensor_parallel_dim=2",
    "tensor_parallel_plan._component_=torchtune.models.llama3.base_llama_tp_plan",
    "batch_size=4",  # dp=1: the same global batch as FSDP=2 x 2
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo runs on Linux"),
]


def run(tmp: Path, overrides: list[str], via_tune: bool = False) -> str:
    """The recipe on 2 processes with the tiny config; returns stdout + stderr.

    ``via_tune``: launched by ``tune run --nproc_per_node 2 muon_plugin/torchtune/...py``;
    otherwise the 2 processes ``tune run`` starts, ``python -m muon_plugin.torchtune.full_finetune``
    as torchrun starts them, forked from a server that imported torch once
    (``tests/support/trainer_launch.py``: the ``tune`` command's and each worker's imports,
    seconds on 2 cores, paid once).
    """
    argv = ["--config", str(CONFIG), *overrides]
    if via_tune:
        cmd = [str(Path(sys.executable).parent / "tune"), "run", "--nproc_per_node", "2", RECIPE]
        proc = subprocess.run(
            [*cmd, *argv],
            cwd=ROOT,
            env=offline_env(tmp),
            capture_output=True,
            text=True,
            timeout=240,
        )
        returncode, out = proc.returncode, proc.stdout + proc.stderr
    else:
        result = run_workers(
            "muon_plugin.torchtune.full_finetune", argv, 2, offline_env(tmp), ROOT, 240
        )
        returncode, out = result.returncode, result.output("0,1")
    if returncode != 0:
        pytest.fail(f"the recipe failed (rc={returncode}):\n{out[-6000:]}")
    return out


def losses(log_dir: Path) -> dict[int, float]:
    """Step -> loss from the DiskLogger file(s) in ``log_dir``."""
    found: dict[int, float] = {}
    for f in sorted(log_dir.glob("*.txt")):
        found.update({int(s): float(v) for s, v in LOSS_RE.findall(f.read_text())})
    return found


def training(data: Path, init: Path, out: Path, extra: list[str]) -> list[str]:
    """Overrides of a 2-epoch run writing to ``out``."""
    return [
        *data_overrides(data, init),
        f"output_dir={out}",
        f"metric_logger.log_dir={out / 'logs'}",
        f"max_steps_per_epoch={STEPS}",
        f"epochs={EPOCHS}",
        "batch_size=2",
        "clip_grad_norm=null",
        f"optimizer.qk_clip_tau={TAU}",
        *extra,
    ]


def resume(log_dir: Path, dcp: bool = False) -> list[str]:
    """Overrides resuming from the run's epoch-0 checkpoint, logging to ``log_dir``: the model
    from ``epoch_0/`` and the rank-0 recipe state, or (``dcp``) both from ``dist_epoch_0/``."""
    files = [] if dcp else ["checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]"]
    return ["resume_from_checkpoint=True", *files, f"metric_logger.log_dir={log_dir}"]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, tt_data: Path, tt_init: Path) -> dict:
    """The uninterrupted FSDP=2 run: its output folder, log and losses."""
    tmp = tmp_path_factory.mktemp("tt_fsdp")
    out = tmp / "run"
    args = training(tt_data, tt_init, out, [])
    log = run(tmp, args, via_tune=True)
    return {"tmp": tmp, "out": out, "args": args, "log": log, "losses": losses(out / "logs")}


def test_fsdp_trains_with_the_class_rules(fsdp: dict) -> None:
    log, got = fsdp["log"], fsdp["losses"]
    assert sorted(got) == list(range(1, STEPS * EPOCHS + 1)), got
    first, last = got[1], (got[STEPS * EPOCHS] + got[STEPS * EPOCHS - 1]) / 2
    assert last < first - 0.3, got
    # One table, from rank 0: Muon on the 14 matrices, AdamW elsewhere, per-class decay.
    assert log.count("Muon param groups:") == 1, log[-4000:]
    rows = {
        m.group(1): m.group(2, 3, 4)
        for m in re.finditer(
            r"^(?:\[rank0\]:)?(matrix|embedding|output|norm|other)\s+(\w+)\s+(\d+)\s+[\d,]+"
            r"\s+\S+\s+\S+\s+(\S+)$",
            log,
            flags=re.M,
        )
    }
    assert rows == {
        "matrix": ("muon", "14", "0.1"),
        "embedding": ("adamw", "1", "0"),
        "output": ("adamw", "1", "0.1"),
        "norm": ("adamw", "5", "0"),
    }, log[-4000:]
    # The plan: FSDP shards, 14 matrices split 7-7 over the 2 ranks.
    assert "Muon orthogonalization plan" in log and "(S(0))" in log
    assert "all groups, 2 rank(s): matrices 7-7" in log
    assert f"Run summary: {STEPS * EPOCHS} logged steps (1-{STEPS * EPOCHS})" in log, log[-3000:]
    assert "tokens/s over all ranks (median of" in log
    assert f"checkpoints: {fsdp['out']} (epoch_0, epoch_1)" in log
    assert "QK-Clip: tau 1, alpha 0.5; 2 attention layers (2 GQA (rule 'query'))" in log
    assert len(check_clipping(log, TAU)) == STEPS * EPOCHS


def test_fsdp_checkpoint_holds_muon_state_and_resumes_exactly(fsdp: dict) -> None:
    out = fsdp["out"]
    # The rank-0 full state dict of epoch 0 (torchtune's recipe_state.pt): groups by class,
    # state keyed by parameter name, full (gathered) momentum for every Muon matrix.
    state = torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=True)["optimizer"]
    algorithms = [g["algorithm"] for g in state["param_groups"]]
    assert algorithms == ["muon", "adamw", "adamw", "adamw"]
    assert state["param_groups"][1]["param_names"] == ["tok_embeddings.weight"]
    assert state["param_groups"][2]["param_names"] == ["output.weight"]
    momentum = state["state"]["layers.0.mlp.w1.weight"]["momentum_buffer"]
    assert momentum.shape == (384, 128) and momentum.abs().sum() > 0
    assert set(state["state"]["output.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    log_dir = fsdp["tmp"] / "resume_logs"
    run(fsdp["tmp"], [*fsdp["args"], *resume(log_dir)])
    resumed = losses(log_dir)
    assert sorted(resumed) == list(range(STEPS + 1, STEPS * EPOCHS + 1)), resumed
    assert resumed == {s: fsdp["losses"][s] for s in resumed}


def test_resume_with_a_changed_option_trains_with_it(fsdp: dict) -> None:
    log_dir = fsdp["tmp"] / "changed_logs"
    log = run(fsdp["tmp"], [*fsdp["args"], *resume(log_dir), "optimizer.ns_steps=1"])
    assert "ns_steps: 5 (checkpoint) -> 1 (job) in matrix" in log, log[-3000:]
    resumed = losses(log_dir)
    assert sorted(resumed) == list(range(STEPS + 1, STEPS * EPOCHS + 1)), resumed
    assert resumed[STEPS + 1] == fsdp["losses"][STEPS + 1]  # the saved weights
    assert resumed[STEPS * EPOCHS] != fsdp["losses"][STEPS * EPOCHS]


def test_tp_with_dcp_matches_fsdp_and_resumes_exactly(
    fsdp: dict, tmp_path: Path, tt_data: Path, tt_init: Path
) -> None:
    out = tmp_path / "run"
    extra = [*TP, "enable_async_checkpointing=True"]
    args = training(tt_data, tt_init, out, extra)
    log = run(tmp_path, args)
    got = losses(out / "logs")
    assert sorted(got) == sorted(fsdp["losses"])
    assert all(abs(got[s] - fsdp["losses"][s]) < 1e-4 for s in got), (got, fsdp["losses"])
    assert "(S(1))" in log  # row-wise TP shards (TP's output projections) in the plan
    assert (out / "dist_epoch_0").is_dir() and not (out / "recipe_state").exists()

    log_dir = tmp_path / "resume_logs"
    resumed_log = run(tmp_path, [*args, *resume(log_dir, dcp=True)])
    assert "DistributedCheckpointer loaded the checkpoint" in resumed_log
    assert "Failed to load distributed checkpoint" not in resumed_log
    resumed = losses(log_dir)
    assert sorted(resumed) == list(range(STEPS + 1, STEPS * EPOCHS + 1)), resumed
    assert resumed == {s: got[s] for s in resumed}


def test_compiled_layers_clip_like_eager(
    fsdp: dict, tt_data: Path, tt_init: Path, monkeypatch
) -> None:
    """``compile=True`` (torchtune compiles each layer; the aot_eager backend keeps it fast):
    QK-Clip's recording is traced into the compiled layers, clips heads as in the eager run,
    and the losses equal the eager FSDP run's."""
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    out = fsdp["tmp"] / "compiled"
    log = run(fsdp["tmp"], training(tt_data, tt_init, out, ["compile=True"]))
    check_clipping(log, TAU)
    got = losses(out / "logs")
    assert sorted(got) == sorted(fsdp["losses"]), got
    for step, loss in fsdp["losses"].items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)


def test_optimizer_in_bwd_fails_in_one_line(monkeypatch, capsys) -> None:
    # What ``tune run RECIPE --config CONFIG optimizer_in_bwd=True`` runs (runpy of the module):
    # the recipe's entry point, parsing the command line with torchtune's config.parse.
    from muon_plugin.torchtune.full_finetune import recipe_main

    monkeypatch.setattr(sys, "argv", [RECIPE, "--config", str(CONFIG), "optimizer_in_bwd=True"])
    with pytest.raises(SystemExit) as info:
        recipe_main()
    assert info.value.code == (
        "config error: optimizer_in_bwd: True is not supported with Muon (it steps one "
        "optimizer per parameter inside the backward pass; Muon updates whole matrices in one "
        "optimizer step): set optimizer_in_bwd: false"
    )  # Python prints a SystemExit message as that one line and exits with status 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # before the config dump or any set-up


def test_a_finished_gloo_run_leaves_without_the_interpreter_teardown(monkeypatch) -> None:
    """gloo's threads can abort the teardown of a run that succeeded (SIGABRT, which failed the
    FSDP runs above once on a loaded machine): a finished gloo run flushes and leaves with 0."""
    import logging
    import os

    from muon_plugin.torchtune import full_finetune

    calls = []
    monkeypatch.setattr(logging, "shutdown", lambda: calls.append("logging"))

    def exit_now(code: int) -> None:
        calls.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit):
        full_finetune.leave_without_teardown()
    assert calls == ["logging", 0]
