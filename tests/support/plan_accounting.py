"""What a distributed step really does, counted, against what its plan says (run in workers).

- :class:`CountingBackend` is the ``"auto"`` backend (registered as ``"counting"``) counting
  the whole matrices it is handed and their Newton-Schulz FLOPs, batch by batch (so row blocks
  and flattened stacks count as the iteration sees them);
- :class:`WireCounter` wraps ``torch.distributed.all_to_all_single`` and counts the bytes each
  call sends and receives and the calls;
- :func:`check_step_accounting` runs one ``optimizer.step()`` under both, gathers every rank's
  counts and compares them with the plan's report: per rank the matrices, FLOPs, bytes sent and
  received and collectives, and the communicator's own statistics.

The scale model (``scripts/plan_at_scale.py``) reports these per-rank quantities from one
simulated process; this is the check that they are what the executor does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon_plugin.distributed.report import totals_per_rank
from muon_plugin.orthogonalize import IterationBackend, register_backend
from muon_plugin.orthogonalize.backends import get_backend

BACKEND = "counting"


class CountingBackend(IterationBackend):
    """``"auto"`` without CUDA graphs (a replayed graph would not call back into Python),
    counting matrices (per stack) and FLOPs (per batch of the iteration)."""

    def __init__(self) -> None:
        super().__init__(replace(get_backend("auto").features, graphs=False))
        self.matrices = 0
        self.flops = 0.0

    def run(self, path, X, spec, out_dtype=None, *, overwrite_input=False):
        self.matrices += len(X)
        return super().run(path, X, spec, out_dtype, overwrite_input=overwrite_input)

    def orthogonalize(self, M, *, scale, spec, path, overwrite_input):
        batch, rows, cols = M.shape
        m, n = sorted((rows, cols))
        self.flops += batch * spec.steps * (4 * m * m * n + 2 * m**3)
        return super().orthogonalize(
            M, scale=scale, spec=spec, path=path, overwrite_input=overwrite_input
        )


class WireCounter:
    """Counts ``all_to_all_single`` traffic while installed (``with WireCounter() as w``)."""

    def __init__(self) -> None:
        self.sent = self.received = self.calls = 0
        self._original: Callable[..., Any] | None = None

    def __enter__(self) -> WireCounter:
        self._original = original = dist.all_to_all_single

        def counted(output, input, *args, **kwargs):
            self.sent += input.numel() * input.element_size()
            self.received += output.numel() * output.element_size()
            self.calls += 1
            return original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._original


def install_counting_backend() -> CountingBackend:
    backend = CountingBackend()
    register_backend(BACKEND, backend, replace=True)
    return backend


def check_step_accounting(
    optimizers: list, step: Callable[[], None], backend: CountingBackend, label: str
) -> list[dict[str, Any]]:
    """Run ``step`` (one ``optimizer.step()`` of ``optimizers``, all on ``backend``) counted;
    assert on every rank that each rank did what the plans say. Returns the plan reports."""
    backend.matrices, backend.flops = 0, 0.0
    with WireCounter() as wire:
        step()
    stats = {"send_bytes": 0, "recv_bytes": 0, "collectives": 0}
    report: list[dict[str, Any]] = []
    for opt in optimizers:
        plan = opt._plans.plan
        report += plan.report()
        for key in stats:
            stats[key] += plan.last_stats.get(key, 0)
    done = {
        "matrices": backend.matrices,
        "flops": backend.flops,
        "send_bytes": wire.sent,
        "recv_bytes": wire.received,
        "collectives": wire.calls,
    }
    assert stats == {k: done[k] for k in stats}, f"{label}: communicator stats {stats}, wire {done}"
    everyone: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, done)
    planned = totals_per_rank(report)
    assert all(row["placements"] != "local" for row in report), f"{label}: a local group"
    assert sorted(planned) == list(range(dist.get_world_size())), f"{label}: {sorted(planned)}"
    for rank, got in enumerate(everyone):
        want = dict(planned[rank])
        want["collectives"] = sum(row["collectives"] for row in report if rank in row["ranks"])
        assert got == want, f"{label}: rank {rank} did {got}, its plan says {want}"
    return report


def random_grads(named: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
    """Random gradients laid out like each parameter, equal on replicas of the same shard (a
    seed from the name, the step and the shard's coordinates on the non-Replicate mesh dims)."""
    for name, p in named:
        grad = torch.zeros_like(p)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        key: tuple = ()
        if isinstance(p, DTensor):
            coord = p.device_mesh.get_coordinate()
            key = tuple(
                c for c, pl in zip(coord, p.placements, strict=True) if not pl.is_replicate()
            )
        gen = torch.Generator().manual_seed(zlib.crc32(repr((name, step, key)).encode()))
        local.copy_(torch.randn(local.shape, generator=gen))
        p.grad = grad


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
