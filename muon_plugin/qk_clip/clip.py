"""QK-Clip for one rank's attention layers: record the step's max logits, reduce them, clip.

:class:`QKClip` holds, per layer, this rank's heads (after tensor parallelism), a running MAX
per query head over the step's forwards (gradient accumulation, pipeline microbatches and a
recomputed checkpointed layer all fold in; forwards without autograd are left out), and the
row plans of the layer's parameters. :meth:`QKClip.step`, run after the optimizer step:

1. one ``all_reduce(MAX)`` of every layer's vector at once over ``group`` (the data-parallel
   and context-parallel ranks: ranks that saw other tokens of the same heads; never tensor or
   pipeline ranks, whose heads differ), so every replica and shard applies the same factors;
2. the factors of :class:`~muon_plugin.qk_clip.rule.ClipRule`, multiplied into the local rows
   (:mod:`muon_plugin.qk_clip.rescale`) of the parameters and of any registered copy;
3. the statistic of the step is kept for :meth:`QKClip.report` and the running max reset.

Nothing in :meth:`~QKClip.record` or :meth:`~QKClip.step` synchronizes with the host (no
``.item()``, no data-dependent branch): :meth:`~QKClip.report` reads the kept tensors once,
when the framework logs. Optimizer state (momentum) is never touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from muon_plugin.defaults import QK_CLIP_ALPHA, QK_CLIP_CHUNK_BYTES, QK_CLIP_GQA_RULE
from muon_plugin.distributed.layout import local
from muon_plugin.qk_clip.heads import AttentionHeads
from muon_plugin.qk_clip.logits import (
    flex_from_env,
    is_real,
    max_logit_per_head,
    outside_dispatch_modes,
    should_record,
    statistic_path,
)
from muon_plugin.qk_clip.rescale import HeadRange, RowPlan, plan_rows
from muon_plugin.qk_clip.rule import ClipRule, LocalLayer
from muon_plugin.qk_clip.visibility import Visibility

__all__ = ["HEAD_PARALLEL_DIMS", "QKClip", "QKClipReport", "head_range"]

HEAD_PARALLEL_DIMS = ("tp",)
"""Mesh dim names that split attention heads (tensor parallelism)."""

TOP_HEADS = 8
"""Clipped heads named in a report line (the largest first)."""


def _head_split(param: Tensor, names: Sequence[str]) -> tuple[int, int]:
    """``(ways, index)`` of the head-parallel split of ``param``'s rows; ``(1, 0)`` if none."""
    if not isinstance(param, DTensor):
        return 1, 0
    mesh = param.device_mesh
    dim_names = mesh.mesh_dim_names or ()
    for i, placement in enumerate(param.placements):
        if i < len(dim_names) and dim_names[i] in names and mesh.size(i) > 1:
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim in (0, -param.dim()):
                return mesh.size(i), mesh.get_local_rank(i)
    return 1, 0


def head_range(layer: AttentionHeads, names: Sequence[str] = HEAD_PARALLEL_DIMS) -> HeadRange:
    """The heads of ``layer`` on this rank: all of them, or one tensor-parallel rank's
    contiguous share (column-parallel projections split heads in order)."""
    q_param = next(b.param for b in layer.blocks if b.part == "q")
    ways, index = _head_split(q_param, names)
    if layer.n_heads % ways or layer.n_kv_heads % ways:
        raise ValueError(
            f"QK-Clip: attention {layer.name!r}: {layer.n_heads} query and {layer.n_kv_heads} "
            f"key heads do not split over {ways} tensor-parallel ranks"
        )
    n_q, n_kv = layer.n_heads // ways, layer.n_kv_heads // ways
    return HeadRange(index * n_q, n_q, index * n_kv, n_kv)


@dataclass
class QKClipReport:
    """What the last :meth:`QKClip.step` saw and did, read on the host."""

    tau: float
    steps: int
    """Steps applied so far."""
    layer_names: list[str]
    layer_max: list[float]
    """Per layer, the largest logit of this rank's heads (-inf: nothing recorded)."""
    clipped: list[tuple[str, int, float]] = field(default_factory=list)
    """``(layer, global head, S)`` of the heads this step clipped, largest S first."""
    after_clip: list[tuple[str, int, float]] = field(default_factory=list)
    """``(layer, head, S)``: this step's max logit of each head the previous step clipped."""
    nonfinite: list[tuple[str, int]] = field(default_factory=list)
    """Heads whose max logit was NaN or infinite this step (not clipped)."""
    nonpositive: list[tuple[str, int, float]] = field(default_factory=list)
    """Heads whose max logit was finite and <= 0 this step (nothing to clip)."""
    clipped_total: int = 0
    """Head clips applied so far on this rank."""

    @property
    def max_logit(self) -> float:
        return max(self.layer_max, default=float("-inf"))

    def metrics(self, prefix: str = "qk_clip") -> dict[str, float]:
        """Scalars for a metrics logger: the max logit (overall and per layer) and the number
        of heads clipped this step."""
        out = {f"{prefix}/max_logit": self.max_logit, f"{prefix}/heads_clipped": len(self.clipped)}
        for i, value in enumerate(self.layer_max):
            out[f"{prefix}/max_logit_layer_{i}"] = value
        return out

    def format(self, top: int = TOP_HEADS) -> str:
        """One log line: the max logit and where, the heads clipped (largest first)."""
        where = ""
        if self.layer_max and math.isfinite(self.max_logit):
            where = f" ({self.layer_names[self.layer_max.index(self.max_logit)]})"
        text = f"QK-Clip: max logit {self.max_logit:.4g}{where}, {len(self.clipped)} heads clipped"
        text += f" at tau {self.tau:g}"

        def heads(items: list[tuple[str, int, float]]) -> str:
            shown = ", ".join(f"{n} h{h} {s:.4g}" for n, h, s in items[:top])
            more = len(items) - top
            return shown + (f", +{more} more" if more > 0 else "")

        if self.clipped:
            text += ": " + heads(self.clipped)
        if self.after_clip:
            text += "; heads clipped at the previous step now: " + heads(self.after_clip)
        return text

    def warnings(self) -> list[str]:
        """Warnings for heads whose max logit was not finite or not positive."""
        out = []
        if self.nonfinite:
            names = ", ".join(f"{n} h{h}" for n, h in self.nonfinite[:TOP_HEADS])
            out.append(
                f"QK-Clip: {len(self.nonfinite)} heads had a non-finite max logit (NaN or inf) "
                f"this step and were not clipped: {names}"
            )
        if self.nonpositive:
            names = ", ".join(f"{n} h{h} {s:.3g}" for n, h, s in self.nonpositive[:TOP_HEADS])
            out.append(
                f"QK-Clip: {len(self.nonpositive)} heads had a max logit <= 0 this step (no "
                f"positive logit: nothing to clip, left as they are): {names}"
            )
        return out


class QKClip:
    """Bound every attention head's max pre-softmax logit by ``tau`` after each step.

    ``layers``: this rank's attention layers (:class:`~muon_plugin.qk_clip.heads.
    AttentionHeads`, parameters as they are: plain tensors or DTensors of any dim-0 layout).
    ``group``: the process group whose ranks saw other tokens of the same heads (data- and
    context-parallel); None when there is none. ``head_parallel``: mesh dim names that split
    heads (tensor parallelism). ``copies``: ``id(param) -> tensors`` shaped like its local
    shard that must take the same factors (an fp32 master, a low-precision copy). ``flex``:
    whether the statistic may take the fused FlexAttention path on CUDA (None: yes unless
    ``MUON_PLUGIN_QK_CLIP_FLEX=0``, read here, once).
    """

    def __init__(
        self,
        layers: Sequence[AttentionHeads],
        *,
        tau: float,
        alpha: float = QK_CLIP_ALPHA,
        gqa_rule: str = QK_CLIP_GQA_RULE,
        group: dist.ProcessGroup | None = None,
        head_parallel: Sequence[str] = HEAD_PARALLEL_DIMS,
        copies: dict[int, list[Tensor]] | None = None,
        chunk_bytes: int = QK_CLIP_CHUNK_BYTES,
        flex: bool | None = None,
    ) -> None:
        if not layers:
            raise ValueError("QK-Clip: no attention layer to clip")
        self.layers = list(layers)
        self.ranges = [head_range(layer, head_parallel) for layer in self.layers]
        device = local(self.layers[0].blocks[0].param).device
        self.device = device
        local_layers = [
            LocalLayer(r.n_q, r.n_kv, layer.has_rope_queries)
            for layer, r in zip(self.layers, self.ranges, strict=True)
        ]
        self.rule = ClipRule(local_layers, tau, alpha, gqa_rule, device)
        self.group = group
        self.chunk_bytes = chunk_bytes
        self.flex = flex_from_env() if flex is None else flex

        def slot(li: int, part: str, head: int) -> int:
            if part == "q":
                return self.rule.q_slot(li, head)
            if part == "k":
                return self.rule.k_slot(li, head)
            return self.rule.rope_slot(li, head)

        self.plans: list[RowPlan] = plan_rows(
            self.layers, self.ranges, slot, self.rule.one_slot, device, copies
        )
        n = self.rule.num_q
        self._running = torch.full((n,), float("-inf"), device=device)
        self.last_max = torch.full((n,), float("-inf"), device=device)
        self._clipped = torch.zeros(n, dtype=torch.bool, device=device)
        self._previous = torch.zeros(n, dtype=torch.bool, device=device)
        self._clipped_total = torch.zeros((), dtype=torch.int64, device=device)
        self._forwards = [0] * len(self.layers)  # forwards recorded this step, per layer
        self.steps = 0

    @property
    def tau(self) -> float:
        return self.rule.tau

    def describe(self) -> str:
        """One line for the build log: the settings and what is clipped."""
        kinds = []
        mla = sum(layer.has_rope_queries for layer in self.layers)
        gqa = sum(layer.grouped for layer in self.layers)
        if mla:
            kinds.append(f"{mla} MLA")
        if gqa:
            kinds.append(f"{gqa} GQA (rule {self.rule.gqa_rule!r})")
        heads = sum(layer.n_heads for layer in self.layers)
        return (
            f"QK-Clip: tau {self.rule.tau:g}, alpha {self.rule.alpha:g}; {len(self.layers)} "
            f"attention layers ({', '.join(kinds) if kinds else 'multi-head'}), {heads} query "
            f"heads, {len(self.plans)} parameters rescaled on this rank; statistic: "
            f"{statistic_path(self.device, self.flex)}"
        )

    # ----- recording (inside the forward)

    def record(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        *,
        scale: float | None = None,
        visible: Visibility | None = None,
    ) -> None:
        """Fold one attention call's max logits into the step's statistic of ``layer``.

        ``q``: ``[B, local query heads, Lq, D]``, ``k``: ``[B, local key heads, Lk, D]``, the
        tensors the attention multiplies (after rope and norms); nothing is recorded without
        autograd (validation, inference) or for meta / fake tensors. An activation-checkpointed
        layer's recomputation (inside the backward) is skipped when its forward was recorded
        (non-reentrant checkpointing); after a forward without autograd (reentrant
        checkpointing) the recomputation is the one recorded. The computation runs outside any
        dispatch mode (:func:`~muon_plugin.qk_clip.logits.outside_dispatch_modes`).
        """
        if not should_record():
            return
        if not torch.compiler.is_compiling():
            recomputing = torch._C._current_graph_task_id() != -1
            if recomputing and self._forwards[layer]:
                return
            if not recomputing:
                self._forwards[layer] += 1
        if isinstance(q, DTensor):
            q = q.to_local()
        if isinstance(k, DTensor):
            k = k.to_local()
        if not (is_real(q) and is_real(k)):
            return
        r = self.ranges[layer]
        if q.shape[1] != r.n_q:
            raise ValueError(
                f"QK-Clip: attention {self.layers[layer].name!r} ran with {q.shape[1]} query "
                f"heads on this rank, its parameters give it {r.n_q}"
            )
        with outside_dispatch_modes():
            s = max_logit_per_head(
                q, k, scale=scale, visible=visible, chunk_bytes=self.chunk_bytes, flex=self.flex
            )
            self.record_max(layer, s)

    def record_max(self, layer: int, s: Tensor) -> None:
        """Fold per-head max logits ``s`` (``[local query heads]``) into ``layer``'s."""
        start = self.rule.q_offsets[layer]
        view = self._running[start : start + self.ranges[layer].n_q]
        torch.maximum(view, s.detach().to(device=view.device, dtype=view.dtype), out=view)

    # ----- after the optimizer step

    def reduced(self) -> Tensor:
        """The step's per-head max logits, MAX-reduced over ``group`` (a NaN counts as +inf,
        so that every rank sees it), and the running max reset."""
        inf = float("inf")
        s = torch.nan_to_num(self._running, nan=inf, posinf=inf, neginf=-inf)
        self._running.fill_(float("-inf"))
        self._forwards = [0] * len(self.layers)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=self.group)
        return s

    def step(self) -> None:
        """Reduce the step's statistic, rescale the clipped heads' rows, keep the statistic."""
        s = self.reduced()
        factors = self.rule.factors(s)
        for plan in self.plans:
            plan.apply(factors)
        self._previous.copy_(self._clipped)
        self._clipped.copy_(self.rule.clipped(s))
        self._clipped_total.add_(self._clipped.sum())
        self.last_max.copy_(s)
        self.steps += 1

    # ----- reporting (host side, at log steps)

    def report(self) -> QKClipReport:
        """The last step's statistic and clips, read to the host (one synchronization)."""
        s = self.last_max.cpu().tolist()
        clipped = self._clipped.cpu().tolist()
        previous = self._previous.cpu().tolist()
        total = int(self._clipped_total.cpu())
        names = [layer.name for layer in self.layers]
        rep = QKClipReport(self.rule.tau, self.steps, names, [], clipped_total=total)
        for li, (layer, r) in enumerate(zip(self.layers, self.ranges, strict=True)):
            start = self.rule.q_offsets[li]
            values = s[start : start + r.n_q]
            recorded = [v for v in values if v != float("-inf")]
            rep.layer_max.append(max(recorded, default=float("-inf")))
            for i, v in enumerate(values):
                head = r.q_start + i
                if clipped[start + i]:
                    rep.clipped.append((layer.name, head, v))
                if previous[start + i]:
                    rep.after_clip.append((layer.name, head, v))
                if v == float("-inf"):
                    continue
                if not math.isfinite(v):
                    rep.nonfinite.append((layer.name, head))
                elif v <= 0:
                    rep.nonpositive.append((layer.name, head, v))
        rep.clipped.sort(key=lambda t: -t[2])
        return rep
