"""Spawning the multi-process tests: gloo on CPU (default) or NCCL on GPUs.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (forked from a
forkserver that has imported torch once, on Linux; spawned elsewhere),
initializes a process group over TCP on a free local port with a short timeout, calls
``fn(rank, world_size, *args)`` in each, and re-raises the first failure in the caller. A rank
that raises makes the others terminate instead of hanging in a collective.

The backend comes from ``MUON_TEST_BACKEND``: ``gloo`` (default; CPU tensors and meshes),
``nccl`` (rank ``r`` uses ``cuda:r``; a test needing more ranks than there are GPUs is skipped)
or ``gloo-cuda`` (gloo with every rank's tensors on ``cuda:0``: several ranks on one GPU, which
NCCL refuses; c10d collectives work there, DTensor's functional ones may not).
Tests build their meshes with ``init_device_mesh(device_type(), ...)`` and put plain tensors on
``device()``, so the same scenarios run on both. ``exact()`` says whether bitwise parity with a
single process can be asserted (gloo) or only closeness (NCCL, see ``GPU_UPDATE_RTOL``).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 90
BACKEND_ENV = "MUON_TEST_BACKEND"
BACKENDS = ("gloo", "nccl", "gloo-cuda")

# Parity tolerance on GPUs. On CPU the distributed step equals the single-process one bit for
# bit: bf16 Newton-Schulz of identical matrices is deterministic however they are stacked, so
# the gloo tests assert equality. On GPUs cuBLAS chooses its kernel (tile shape, split-K) by
# problem size, batch count included, and the owner of a matrix stacks it with other matrices
# than the single-process reference does; one of the five bf16 iterations can then round some
# elements one ulp differently, and Polar Express amplifies that in the small singular
# directions. Perturbing the input of the test matrices by half a bf16 ulp on CPU changes their
# update by up to 18% (relative Frobenius norm) for a 2 x 24 matrix, 6% for 16 x 24, 2% for
# 64 x 64. A misplaced shard, a wrong owner or a result returned to the wrong rank changes the
# update completely (relative difference ~1 or more), so on NCCL each Muon parameter's update
# (parameter minus its initial value) must be within GPU_UPDATE_RTOL of the reference update;
# the learning-rate and shape rules are device-independent and stay checked exactly on CPU.
GPU_UPDATE_RTOL = float(os.environ.get("MUON_TEST_GPU_UPDATE_RTOL", "0.3"))


def backend() -> str:
    """The process-group backend of the tests: ``$MUON_TEST_BACKEND``, default ``gloo``."""
    name = os.environ.get(BACKEND_ENV, "").strip().lower() or "gloo"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r}: expected one of {BACKENDS}")
    return name


def device_type() -> str:
    """``"cuda"`` on NCCL and gloo-cuda, ``"cpu"`` on gloo: the device type of the meshes."""
    return "cpu" if backend() == "gloo" else "cuda"


def device() -> torch.device:
    """This rank's device: ``cuda:<rank>`` on NCCL (set by the worker), else the CPU."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exact() -> bool:
    """Whether distributed and single-process results are bitwise equal (CPU; see above).

    ``MUON_TEST_EXACT=0`` asks for the GPU comparison on CPU too (to see the differences).
    """
    return backend() == "gloo" and os.environ.get("MUON_TEST_EXACT", "1") != "0"


def update_difference(got: torch.Tensor, ref: torch.Tensor, init: torch.Tensor) -> float:
    """``||(got - init) - (ref - init)|| / ||ref - init||``: distance to the reference update."""
    ref_update = (ref - init).double()
    return ((got - ref).double().norm() / ref_update.norm().clamp_min(1e-30)).item()


def skip_reason(world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run with this backend here, or None if they can."""
    if backend() == "gloo":
        return None
    if not torch.cuda.is_available():
        return f"{BACKEND_ENV}={backend()} but CUDA is not available"
    if backend() == "gloo-cuda":
        return None
    found = torch.cuda.device_count()
    if found < world_size:
        return f"{BACKEND_ENV}=nccl runs one rank per GPU: {world_size} ranks, {found} GPU(s)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    name = backend()
    extra = {}
    if name == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    elif name == "gloo-cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo" if name == "gloo-cuda" else name,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        **extra,
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Print here too: the parent shows only the first failing rank.
        traceback.print_exc()
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    # The rank passed. Leave without the interpreter's teardown: gloo's background threads can
    # make it abort ("terminate called without an active exception", SIGABRT) on a loaded
    # machine, which would fail a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Workers fork from a server process that has imported these once per test session, instead
# of each importing torch afresh (seconds per worker on 2 cores); the server forks before any
# thread or process group exists, so the fork is safe.
PRELOAD = ["torch", "torch.distributed", "muon_plugin", "muon_plugin.distributed.plan"]


def _start_method() -> str:
    if sys.platform != "linux":
        return "spawn"
    mp.set_forkserver_preload(PRELOAD)
    return "forkserver"


def run_distributed(fn, world_size: int, *args, attempts: int = 3) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; raise on failure.

    Skips the calling test when the backend cannot provide ``world_size`` ranks (NCCL with too
    few GPUs). The free port can be taken by another program between probing and binding it;
    such a start (EADDRINUSE) is retried on a new port, as is a rank killed by a signal; any
    exception a rank raises is re-raised at once.
    """
    reason = skip_reason(world_size)
    if reason:
        pytest.skip(reason)
    for attempt in range(attempts):
        try:
            mp.start_processes(
                _worker,
                args=(fn, world_size, free_port(), args),
                nprocs=world_size,
                join=True,
                start_method=_start_method(),
            )
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == attempts - 1:
                raise
        except mp.ProcessExitedException:
            # A rank killed by a signal is retried; a deterministic crash fails every attempt.
            if attempt == attempts - 1:
                raise
