"""Spawn helpers for multi-process gloo tests on CPU.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (spawn start method),
initializes a gloo process group over TCP on a free local port with a short timeout, calls
``fn(rank, world_size, *args)`` in each, and re-raises the first failure in the caller. A rank
that raises makes the others terminate instead of hanging in a collective.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
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


def run_distributed(fn, world_size: int, *args, attempts: int = 3) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; raise on failure.

    The free port can be taken by another program between probing and binding it; such a start
    (EADDRINUSE) is retried on a new port, as is a rank killed by a signal; any exception a rank
    raises is re-raised at once.
    """
    for attempt in range(attempts):
        try:
            mp.start_processes(
                _worker,
                args=(fn, world_size, free_port(), args),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == attempts - 1:
                raise
        except mp.ProcessExitedException:
            # A rank killed by a signal (seen once: gloo aborting in teardown on a loaded
            # 2-core machine) is retried; a deterministic crash fails every attempt.
            if attempt == attempts - 1:
                raise
