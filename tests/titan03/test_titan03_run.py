"""scripts/train.sh on torchtitan 0.3 (``configs/titan03_muon.py``), one process, seconds:

- a typo or a bad value (on the command line, or in the ``optimizer.muon_toml`` file) is ONE
  line naming the key, exit 2, from ``muon_plugin.torchtitan03.check`` before torchrun starts;
- a 4-step run writes its log to ``DUMP_FOLDER/logs/<date-time>/train.log`` (and every rank's
  files) with the end-of-run summary, which only activating the plugin installs; a resume of
  its step-2 checkpoint with a changed Muon option (the same job, its worker forked as torchrun
  starts it: ``tests/support/trainer_launch.py``) trains with the job's option;
- tyro's boxed errors become the same one-line form as on torchtitan 0.2.2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_launch import run_workers

from muon_plugin.param_groups.messages import one_line, unrecognized_options

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/titan03_muon.py:llama3_debug_muon"
JOB = ["--module", "titan03_muon", "--config", "llama3_debug_muon"]
"""CONFIG as train.sh hands it to the check and the workers (``configs/`` importable)."""
TOML = ROOT / "configs" / "llama3_debug_muon.toml"

LOSS_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="torchrun + gloo runs on Linux")


def train_sh(args: list[str], tmp: Path, data: Path | None = None) -> dict[str, Any]:
    """``scripts/train.sh CONFIG ARGS`` (1 process, this python), as ``subprocess`` kwargs."""
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
        env.update(DATA_DIR=str(data), SKIP_PREPARE_DATA="1")
        args = [*data_args(data), *args]
    cmd = ["bash", "scripts/train.sh", CONFIG, *args]
    return {"args": cmd, "cwd": ROOT, "env": env, "text": True}


def data_args(data: Path) -> list[str]:
    """The job's overrides that read the corpus and tokenizer in ``data``."""
    return [
        "--hf_assets_path", str(data / "tokenizer"),
        "--dataloader.dataset_path", str(data / "corpus"),
        "--metrics.disable_color_printing",
    ]  # fmt: skip


def losses(log: str) -> dict[int, float]:
    """Step -> loss as torchtitan logs it."""
    return {int(step): float(loss) for step, loss in LOSS_RE.findall(log)}


_TYPO = "optimizer.muon.ns_stepz: unknown key ({}); did you mean optimizer.muon.ns_steps?"
CASES = {
    "typo": (
        ["--optimizer.muon.ns_stepz", "7"],
        _TYPO.format("command line --optimizer.muon.ns_stepz"),
    ),
    "bad-value": (
        ["--optimizer.muon.ns_steps", "0"],
        "optimizer.muon.ns_steps: invalid value 0; expected ",
    ),
    "toml-typo": (["--optimizer.muon_toml", "{tmp}/bad.toml"], _TYPO.format("in {tmp}/bad.toml")),
    "qk-clip-tau": (
        ["--optimizer.muon.qk_clip_tau", "-1"],
        "optimizer.muon.qk_clip_tau: invalid value -1.0; expected a finite number > 0",
    ),
}
"""name -> (overrides, how the one line after "config error: " starts); {tmp}: a temporary
folder."""


@pytest.fixture
def check_argv(monkeypatch) -> list[str]:
    """The check's arguments for CONFIG, as train.sh passes them, run from the repository root
    with ``configs/`` importable."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "configs"))
    return list(JOB)


@linux_only
def test_config_error_is_one_line_before_torchrun(tmp_path: Path) -> None:
    """train.sh with a typo: one line, exit 2, from the check before torchrun (no worker, no
    log). The other cases take the same path; the check's own function gives their lines
    (next test)."""
    args, start = CASES["typo"]
    proc = subprocess.run(capture_output=True, timeout=300, **train_sh(args, tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == "" and "[rank" not in proc.stderr  # no log, no worker started
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: " + start), proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_each_config_error_is_one_line(case: str, tmp_path: Path, capsys, check_argv) -> None:
    """What train.sh's check prints for each case of CASES: exit status 2 and one line."""
    import muon_plugin.torchtitan03.check

    (tmp_path / "bad.toml").write_text(TOML.read_text().replace("ns_steps = 5", "ns_stepz = 5"))
    args, start = CASES[case]
    argv = [*check_argv, *(a.format(tmp=tmp_path) for a in args)]
    assert muon_plugin.torchtitan03.check.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.replace(str(tmp_path), "{tmp}").splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("config error: " + start), err


@linux_only
@pytest.mark.slow
def test_run_writes_the_log_with_the_summary_and_resumes_with_a_changed_option(
    assets: Path, tmp_path: Path
) -> None:
    """A 4-step run saving at steps 2 and 4, with QK-Clip (the README's command); then, from a
    copy of its step-2 checkpoint, a resume with ``--optimizer.muon.ns_steps 1``: the job's
    setting is logged and trains (the step-3 loss, from the saved weights, is the first run's;
    the step-4 loss differs)."""
    dump = tmp_path / "run"
    args = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    args += ["--optimizer.muon.qk_clip_tau", "0.7"]
    kwargs = train_sh(["--dump_folder", str(dump), *args], tmp_path, assets)
    proc = subprocess.run(capture_output=True, timeout=300, **kwargs)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"train.sh: log: {dump}/logs/") and lines[-1] == lines[0]
    log_file = Path(lines[0].split()[2])
    text = log_file.read_text()
    assert "Run summary: 4 logged steps (1-4)" in text, text[-3000:]
    assert "loss: final " in text and "tokens/s over all ranks" in text
    assert f"checkpoints: {dump}/checkpoint (step-2, step-4)" in text
    assert f"log: {log_file}" in text
    assert "qk-clip tau 0.7 alpha 0.5 gqa query" in text and "QK-Clip: max logit" in text
    ranks = list((log_file.parent / "ranks").rglob("stdout.log"))
    assert ranks and "Run summary" in ranks[0].read_text()

    # the resume: the same job, its worker forked as torchrun starts it (trainer_launch)
    resumed = tmp_path / "resumed"
    shutil.copytree(dump / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    more = ["--optimizer.muon.ns_steps", "1"]
    argv = [*JOB, *data_args(assets), "--dump_folder", str(resumed), *args, *more]
    env = kwargs["env"]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "configs"), env["PYTHONPATH"]])
    run = run_workers("muon_plugin.torchtitan03.train", argv, 1, env, ROOT, 300)
    again = run.output("0")
    assert run.returncode == 0, again[-4000:]
    assert "ns_steps: 5 (checkpoint) -> 1 (job) in matrix" in again, again[-3000:]
    first, second = losses(text), losses(again)
    assert sorted(second) == [3, 4], second
    assert second[3] == first[3] and second[4] != first[4], (first, second)


def test_importing_the_plugin_installs_no_summary() -> None:
    """Only activation wraps torchtitan's MetricsProcessor (the run above shows it does)."""
    from torchtitan.components.metrics import MetricsProcessor

    import muon_plugin.torchtitan03
    import muon_plugin.torchtitan03.check
    import muon_plugin.torchtitan03.summary  # noqa: F401

    assert muon_plugin.torchtitan03.check.main(["--help"]) == 0
    for method in (MetricsProcessor.__init__, MetricsProcessor.log, MetricsProcessor.close):
        assert not getattr(method, "_muon_plugin_hook", False)


def test_summary_finds_the_checkpoint_folder_from_the_config() -> None:
    from muon_plugin.torchtitan03.summary import checkpoint_folder

    config = {"dump_folder": "./x", "checkpoint": {"enable": True, "folder": "ckpt"}}
    kwargs = {"parallel_dims": None, "dump_folder": "/d", "config_dict": config}
    assert checkpoint_folder(object(), (None,), kwargs) == os.path.join("/d", "ckpt")
    config["checkpoint"]["enable"] = False
    assert checkpoint_folder(object(), (None,), kwargs) is None
    assert checkpoint_folder(object(), (None,), {"parallel_dims": None}) is None


TYRO_UNRECOGNIZED = """\
initial_load_model_only=True has no effect without an initial_load_path.
 Unrecognized options
 ------------------------------------------------------------------------------
  Unrecognized options: --trainig.steps, 3
  ------------------------------------------------------------------------------
  Available subcommands: activation-checkpoint:selective,
  activation-checkpoint:full
  ------------------------------------------------------------------------------
  Perhaps you meant:
      --training.steps INT
          How many train steps to run (default: 30)
          in train.py --help
  ------------------------------------------------------------------------------
  For full helptext, run train.py --help
"""

TYRO_VALUE_ERROR = """\
initial_load_model_only=True has no effect without an initial_load_path.
 Value error
 ------------------------------------------------------------------------------
  Error parsing optimizer.muon: optimizer.muon.ns_steps: invalid value 0;
  expected a positive integer
  ------------------------------------------------------------------------------
  For full helptext, see train.py --help
"""


def test_tyro_boxes_become_one_line() -> None:
    assert unrecognized_options(TYRO_UNRECOGNIZED) == (
        "trainig.steps: unknown key (command line --trainig.steps); did you mean training.steps?"
    )
    assert unrecognized_options(TYRO_VALUE_ERROR) is None
    assert one_line(TYRO_VALUE_ERROR) == (
        "optimizer.muon.ns_steps: invalid value 0; expected a positive integer"
    )
    no_flag = TYRO_UNRECOGNIZED.replace("--trainig.steps, 3", "7")
    assert unrecognized_options(no_flag) == "unrecognized command-line arguments: 7"
    # a value after a boolean flag of the command line: that flag is named, with both forms
    args = ["--config", "x", "--compile.enable", "7"]
    assert unrecognized_options(no_flag, args) == (
        "compile.enable: a flag, it takes no value (command line --compile.enable 7); "
        "--compile.enable sets it, --compile.no-enable clears it"
    )
    assert unrecognized_options(no_flag, ["--training.disable_cuda_graphs=7"]).startswith(
        "training.disable_cuda_graphs: a flag, it takes no value (command line "
        "--training.disable_cuda_graphs=7); --training.disable_cuda_graphs sets it, "
        "--training.no-disable-cuda-graphs clears it"
    )


def test_the_check_lists_the_paths_the_job_reads(capsys, check_argv) -> None:
    """After the dump folder, every ``*_path`` the job reads (what train.sh decides on whether
    to build the local corpus), overrides included, absolute."""
    import muon_plugin.torchtitan03.check

    assert (
        muon_plugin.torchtitan03.check.main([*check_argv, "--dataloader.dataset_path", "/c"]) == 0
    )
    root = ROOT.resolve()
    assert capsys.readouterr().out.splitlines() == [
        "./outputs/llama3_debug_muon",
        str(root / "data" / "tokenizer"),
        "/c",
    ]
