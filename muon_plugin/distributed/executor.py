"""The executor: per step, gather -> orthogonalize -> return, for every shape group of a plan.

Per shape group, in bf16: the communicator packs the local pieces for every owner into one
buffer and starts an ``all_to_all_single`` (async); the owned units are assembled into a stack;
the stack is orthogonalized on the group's resolved path (one batched call through the backend's
runner, a CUDA graph where the path says so, or unit by unit when not ``batched``); the results
go back with a second ``all_to_all_single`` (async) and are scattered into each parameter's
local shard. The gathers of the next ``GATHERS_AHEAD`` groups are in flight while a group
computes, and the returns drain at the end. Groups that need no traffic (plain tensors, expert
stacks sharded on the expert dim) make no collective call at all.

**Numerics**: the direction is rounded to bf16 (the wire format) before orthogonalization in
every layout, local ones included, so a parameter's update does not depend on how it is sharded:
``run`` returns, for each parameter, its local shard of
``orthogonalize_stack(full_direction.to(bf16)[None], spec)[0]``.

**Row normalization** (NorMuon, a spec with ``normalization``): each parameter's per-row state
(fp32) goes to the owner of its matrix with the shards (the group's ``rows`` companion, as bf16
words in the same all-to-alls where the rows travel; :mod:`~muon_plugin.distributed.rows`);
the owner computes the rows' factors of its stack of orthogonalized matrices
(:func:`~muon_plugin.orthogonalize.normuon.normuon_factors_`), and the updated states and the
factors go back with the update to every rank holding those rows, where the update step
multiplies each row by its factor. The factors come from whole matrices only, so the update
does not depend on the layout either.

**Out dtype**: where the update takes the foreach path (no elementwise Triton kernel), small
local results come back in the parameter dtype (one cast per stack), so the multi-tensor update
stays on its single-dtype fast path; the grouped kernel reads bf16 directly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from muon_plugin.distributed.communicator import Communicator, InFlight, piece
from muon_plugin.distributed.planner import ShapeGroup
from muon_plugin.distributed.rows import RowStates, row_factors, row_words
from muon_plugin.distributed.schedule import WIRE_DTYPE
from muon_plugin.kernels.elementwise import FUSED_MIN_NUMEL
from muon_plugin.orthogonalize import elementwise_kernels_allowed, get_backend, run_path

# Shape groups whose gathers are in flight while one group computes.
GATHERS_AHEAD = 2
# CUDA-graphed groups replayed side by side on their own streams (H200, GPT-125M: the three
# groups of 72 small matrices run 11% faster overlapped than one after another).
MAX_CONCURRENT_GROUPS = 3

Stack = Tensor | list[Tensor]


class Executor:
    """Runs a plan's shape groups every step through ``communicator``."""

    def __init__(
        self, groups: Sequence[ShapeGroup], communicator: Communicator, batched: bool
    ) -> None:
        self.groups = groups
        self.comm = communicator
        self.batched = batched
        # Per group (by id): its batched orthogonalization, built at its first step.
        self._runners: dict[int, Callable[[Stack], Tensor]] = {}
        # Per device: the side streams on which the graphs of groups without return traffic
        # run concurrently (groups take them in turn).
        self._side_streams: dict[torch.device, list[torch.cuda.Stream]] = {}
        self._side_turns: Counter[torch.device] = Counter()

    def run(
        self,
        directions: Sequence[Tensor | None],
        groups: Sequence[ShapeGroup] | None = None,
        rows: Sequence[Tensor | None] | None = None,
        factors: list[Tensor | None] | None = None,
    ) -> list[Tensor | None]:
        """Per parameter, the local shard (bf16, shaped like its direction) of the update; of
        the parameters of ``groups`` only when given (a phase of groups without traffic).

        ``rows``: per parameter of a group with a row normalization, its local per-row state
        (fp32, :meth:`MatrixSpec.row_shape <muon_plugin.orthogonalize.MatrixSpec.row_shape>`
        of its local shard), updated in place; None elsewhere. ``factors`` (a list as long as
        ``directions``) receives, at those parameters' positions, their rows' factors (fp32,
        shaped like the state): their update is the returned one times these, row by row.
        """
        self.comm.reset_stats()
        out: list[Tensor | None] = [None] * len(directions)
        groups = self.groups if groups is None else groups
        normalized = [g for g in groups if g.rows is not None]
        if normalized and (rows is None or factors is None):
            raise ValueError(
                f"{normalized[0].names[0]!r}: its group normalizes rows, but no per-row state "
                "was given"
            )
        states = None if rows is None else RowStates(rows, factors)  # type: ignore[arg-type]
        words = {id(g): states.words(g) for g in normalized} if states is not None else {}
        gathers: list[InFlight | None] = [None] * len(groups)
        backs: list[tuple[InFlight | None, Any, Tensor | None, Tensor | None]] = []
        launched = 0
        for gi, group in enumerate(groups):
            while launched < len(groups) and launched <= gi + GATHERS_AHEAD:
                later = groups[launched]
                gathers[launched] = self.comm.start_gather(later, directions, words.get(id(later)))
                launched += 1
            stack = self._assemble(group, directions, gathers[gi])
            row_stack = None
            if states is not None:
                row_stack = states.assemble(group, words.get(id(group), {}), gathers[gi])
            gathers[gi] = None
            result = self._orthogonalize(group, stack)
            factor_stack = None
            if group.back_comm:  # no side stream: the result is ready on this stream
                factor_stack = row_factors(group, result, row_stack)
            back = self.comm.start_return(
                group,
                result,
                None if row_stack is None else row_words(row_stack),
                None if factor_stack is None else row_words(factor_stack),
            )
            backs.append((back, result, row_stack, factor_stack))
        for streams in self._side_streams.values():  # the graphs' results are read below
            for stream in streams:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
        # Every group's row factors first, so that their kernels run back to back instead of
        # between the copies of each group's states back to their parameters.
        backs = [
            (back, result, row_stack, factors)
            if group.back_comm
            else (back, result, row_stack, row_factors(group, result, row_stack))
            for group, (back, result, row_stack, factors) in zip(groups, backs, strict=True)
        ]
        for group, (back, result, row_stack, factor_stack) in zip(groups, backs, strict=True):
            self._scatter(group, directions, back, result, out)
            if states is not None:
                group_words = words.get(id(group), {})
                states.scatter(group, group_words, back, row_stack, factor_stack)
        return out

    def _assemble(
        self, group: ShapeGroup, directions: Sequence[Tensor], pending: InFlight | None
    ) -> Stack | None:
        """The stack of units this rank owns: its own pieces and the received ones."""
        sched = group.schedule
        if sched.direct is not None:
            if pending is not None:
                pending.work.wait()  # others' traffic; nothing arrives here
            if not sched.direct:
                return None
            return [piece(directions[group.indices[k]], b) for k, b in sched.direct]
        stack = None
        dsts, srcs = [], []
        if sched.slots:
            stack = torch.empty(
                (len(sched.slots), *group.unit_shape), dtype=WIRE_DTYPE, device=group.device
            )
            for slot, k, local_b, rects in sched.gather_self:
                part = piece(directions[group.indices[k]], local_b)
                for unit_sl, piece_sl in rects:
                    dsts.append(stack[slot][unit_sl])
                    srcs.append(part[piece_sl])
        if pending is not None:
            pending.work.wait()
            for (slot, _, rects), part in pending.received(0):
                assert stack is not None
                for unit_sl, piece_sl in rects:
                    dsts.append(stack[slot][unit_sl])
                    srcs.append(part[piece_sl])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return stack

    def _orthogonalize(self, group: ShapeGroup, stack: Stack | None) -> Stack | None:
        """The orthogonalized slots: one stacked tensor (``batched``) or one tensor per slot."""
        if stack is None:
            return None
        if self.batched:
            return self._runner(group)(stack)
        path, spec = group.path, group.spec
        assert path is not None
        if isinstance(stack, Tensor):  # assembled here: each slot may be overwritten
            return [
                run_path(path, stack[s : s + 1], spec, overwrite_input=True)[0]
                for s in range(len(stack))
            ]
        return [run_path(path, [x], spec)[0] for x in stack]

    def _runner(self, group: ShapeGroup) -> Callable[[Stack], Tensor]:
        """The group's batched orthogonalization: its backend's runner on its resolved path.

        A graphed group whose results stay on this rank gets a side stream of its own (taken
        in turn, at most ``MAX_CONCURRENT_GROUPS`` per device), so small groups overlap on the
        GPU; ``run`` joins every side stream before the results are read.
        """
        runner = self._runners.get(id(group))
        if runner is None:
            path = group.path
            assert path is not None
            stream = None
            if path.graph and not group.back_comm:
                stream = self._side_stream(group.device)
            size = len(group.schedule.slots)
            runner = get_backend(path.backend).runner(
                path,
                group.spec,
                out_dtype(group),
                name=f"{size} matrices of shape {group.unit_shape} ({group.names[0]}, ...)",
                stream=stream,
                scratch=True,  # a stack is the pieces (stacked anew) or assembled here
            )
            self._runners[id(group)] = runner
        return runner

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = self._side_streams.setdefault(device, [])
        if len(streams) < MAX_CONCURRENT_GROUPS:
            streams.append(torch.cuda.Stream(device))
        stream = streams[self._side_turns[device] % len(streams)]
        self._side_turns[device] += 1
        return stream

    def _scatter(
        self,
        group: ShapeGroup,
        directions: Sequence[Tensor],
        pending: InFlight | None,
        result: Any,
        out: list[Tensor | None],
    ) -> None:
        """Each parameter's local shard of the results: views, local copies, received pieces."""
        dsts, srcs = _scatter_local(group, result, out)
        if pending is not None:
            pending.work.wait()
            single = not group.batch_dims  # one unit per parameter
            for (k, local_b, _), part in pending.received(0):
                i = group.indices[k]
                if single:
                    out[i] = part
                else:
                    dsts.append(piece(_fresh(group, out, i), local_b))
                    srcs.append(part)
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def out_dtype(group: ShapeGroup) -> torch.dtype | None:
    """The dtype a batched group's results come back in (None: bf16); see the module doc."""
    assert group.path is not None
    foreach_update = group.device.type != "cuda" or not elementwise_kernels_allowed(
        group.path.backend
    )
    small = not group.back_comm and math.prod(group.shape) < FUSED_MIN_NUMEL
    return group.dtype if foreach_update and small else None


def _fresh(group: ShapeGroup, out: list[Tensor | None], i: int) -> Tensor:
    if out[i] is None:
        out[i] = torch.empty(group.local_shape, dtype=WIRE_DTYPE, device=group.device)
    return out[i]  # type: ignore[return-value]


def _scatter_local(
    group: ShapeGroup, result: Any, out: list[Tensor | None]
) -> tuple[list[Tensor], list[Tensor]]:
    """Fill ``out`` from this rank's own results (views where whole); the copies left to do."""
    sched = group.schedule
    local_shape = group.local_shape
    single = not group.batch_dims  # one unit per parameter
    for k, i in enumerate(group.indices):
        if k in sched.whole_views:
            first = sched.whole_views[k]
            n = math.prod(local_shape[d] for d in group.batch_dims)
            part = result[first : first + n]
            out[i] = (part if isinstance(part, Tensor) else torch.stack(part)).view(local_shape)
        elif math.prod(local_shape) == 0:
            _fresh(group, out, i)
    dsts, srcs = [], []
    for slot, k, local_b, rects in sched.back_self:
        if k in sched.whole_views:
            continue
        i = group.indices[k]
        if single and len(rects) == 1:
            out[i] = result[slot][rects[0][0]]
            continue
        dest = piece(_fresh(group, out, i), local_b)
        for unit_sl, piece_sl in rects:
            dsts.append(dest[piece_sl])
            srcs.append(result[slot][unit_sl])
    return dsts, srcs
