"""torchrun's part of a test's training run, without its per-process imports.

``run_workers(target, argv, nproc, env, cwd, timeout)`` starts ``nproc`` workers the way
``torchrun --standalone --nproc_per_node N -m TARGET ARGV`` does (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and torchrun's other variables; ``python -m
TARGET`` through ``runpy``; a worker that fails ends the others) and returns each rank's output.
The workers fork from the forkserver of :mod:`dist_utils`, whose preload list this module
extends with the torch modules a trainer imports (DTensor, FSDP, DCP, pipelining, Dynamo,
Inductor, FlexAttention): on 2 CPU cores those imports are about 8 s per worker, most of a
short run. Nothing of torchtitan or torchtune is preloaded: their plugins patch them when a
worker activates them, as in a fresh process.

The README's commands themselves (``scripts/train.sh``, ``tune run``) keep their own tests that
run them as a user does; the runs that check training (layouts, resumes, pipeline stages,
experts) use this.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp
from dist_utils import PRELOAD, _start_method, free_port

# Imported once by the forkserver (all of torch's own; no thread is started by them).
TRAINER_PRELOAD = [
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.nn.attention.flex_attention",
]
PRELOAD.extend(m for m in TRAINER_PRELOAD if m not in PRELOAD)
# Read when the forkserver's imports run (huggingface's offline switches, OpenMP's thread
# count), so they are set before it starts; every run of these tests sets the same values.
for _name, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("OMP_NUM_THREADS", "1"),
):
    os.environ.setdefault(_name, _value)


@dataclass
class Run:
    """A finished run: its exit status (torchrun's: the first failing worker's, 124 on a
    timeout) and each rank's stdout and stderr."""

    returncode: int
    outputs: list[str]

    def output(self, ranks: str = "0") -> str:
        """The output of ``ranks`` (``"0"``, ``"0,1"``), in rank order."""
        return "".join(self.outputs[int(r)] for r in ranks.split(","))


def _worker(
    rank: int, world: int, port: int, target: str, argv: list[str], env: dict, cwd: str, logs: str
) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="none",
    )
    # python -m TARGET: the working directory first, then PYTHONPATH's entries
    paths = [cwd, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    fd = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = [target, *argv]
    code = 0
    try:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: gloo's threads can abort it after a run that passed
    os._exit(code)


def run_workers(
    target: str, argv: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float
) -> Run:
    """``torchrun --standalone --nproc_per_node NPROC -m TARGET ARGV`` with environment
    ``env`` in ``cwd``, the workers forked from the preloaded server; ``timeout`` in seconds.

    The free port can be taken by another program between probing and binding it (torchrun's
    own rendezvous has no such gap): a run that failed with ``EADDRINUSE`` is started once more
    on a new port."""
    run = _run_once(target, argv, nproc, env, cwd, timeout)
    if run.returncode not in (0, 124) and any("EADDRINUSE" in out for out in run.outputs):
        run = _run_once(target, argv, nproc, env, cwd, timeout)
    return run


def _run_once(
    target: str, argv: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float
) -> Run:
    with tempfile.TemporaryDirectory(prefix="trainer-logs-") as logs:
        args = (nproc, free_port(), target, list(argv), dict(env), str(cwd), logs)
        ctx = mp.start_processes(
            _worker, args=args, nprocs=nproc, join=False, start_method=_start_method()
        )
        deadline = time.monotonic() + timeout
        returncode = 0
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    returncode = 124
                    break
        except mp.ProcessExitedException as e:  # the others are ended by join
            returncode = e.exit_code or 1
        outputs = []
        for rank in range(nproc):
            path = Path(logs) / f"rank{rank}.log"
            outputs.append(path.read_text(errors="replace") if path.exists() else "")
    if returncode == 124:
        outputs[0] += f"\n[trainer_launch] timed out after {timeout:.0f} s\n"
    return Run(returncode, outputs)
