"""Which parameter rows belong to which attention head: the description QK-Clip rescales.

An attention layer is described by :class:`AttentionHeads`: its query and key head counts and
a list of :class:`RowBlock` s, each a contiguous range of rows (dim 0) of one parameter that
belongs to one head, with its part:

- ``"q"``: the rows of query head ``h`` that meet a per-head key (scaled by ``gamma^alpha``);
- ``"k"``: the rows of key head ``g`` (``gamma^(1 - alpha)``, or the GQA rule's factor);
- ``"q_rope"``: MLA's per-head rope query rows, which meet the rope key shared by all heads
  (scaled by ``gamma``; the shared key is not listed, so it is never touched).

Rows a layer does not list (values, MLA's shared rope key, anything else in a fused weight)
are never changed. A bias is described like a weight (its single dim is the row dim). Builders
for the usual layouts: :func:`separate_projections` (``wq`` / ``wk``, optional biases),
:func:`fused_qkv` (one weight holding q, k and v rows, grouped per KV head or stacked) and
:func:`mla` (DeepSeek-V3's split projections). Nothing here imports a training framework.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = [
    "PARTS",
    "AttentionHeads",
    "LayoutDescriptionError",
    "RowBlock",
    "fused_qkv",
    "mla",
    "separate_projections",
]

PARTS = ("q", "k", "q_rope")
"""The row parts a block can be: query, key, MLA rope query."""


class LayoutDescriptionError(ValueError):
    """A head description that does not fit the parameters it names."""


@dataclass(frozen=True, eq=False)
class RowBlock:
    """Rows ``[start, start + rows)`` (global dim-0 indices) of ``param`` belong to ``head``."""

    param: Tensor
    name: str
    """The parameter's FQN (messages)."""
    part: str
    """``"q"``, ``"k"`` or ``"q_rope"``."""
    head: int
    """Global query head (``q``, ``q_rope``) or key head (``k``)."""
    start: int
    rows: int


@dataclass(frozen=True, eq=False)
class AttentionHeads:
    """One attention layer: its head counts and the row blocks of its query and key heads."""

    name: str
    """The attention module's FQN (messages and metrics)."""
    n_heads: int
    """Query heads (global, before tensor parallelism)."""
    n_kv_heads: int
    """Key heads; fewer than ``n_heads`` with grouped-query attention."""
    blocks: tuple[RowBlock, ...]

    def __post_init__(self) -> None:
        self.check()

    @property
    def grouped(self) -> bool:
        """Whether a key head serves several query heads (grouped-query attention)."""
        return self.n_kv_heads < self.n_heads

    @property
    def has_rope_queries(self) -> bool:
        """Whether the layer has MLA rope-query rows."""
        return any(b.part == "q_rope" for b in self.blocks)

    def params(self) -> list[tuple[str, Tensor]]:
        """The parameters the layer's blocks touch, each once, in order of appearance."""
        seen: dict[int, tuple[str, Tensor]] = {}
        for b in self.blocks:
            seen.setdefault(id(b.param), (b.name, b.param))
        return list(seen.values())

    def check(self) -> None:
        """Raise :class:`LayoutDescriptionError` naming the layer when the description is
        inconsistent: head counts, parts, head indices, rows outside a parameter, overlaps,
        or a head without query or key rows."""
        where = f"QK-Clip: attention {self.name!r}"
        if self.n_heads < 1 or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise LayoutDescriptionError(
                f"{where}: {self.n_heads} query heads are not a multiple of "
                f"{self.n_kv_heads} key heads"
            )
        spans: dict[int, list[tuple[int, int, str]]] = {}
        covered = {part: set() for part in PARTS}
        for b in self.blocks:
            if b.part not in PARTS:
                raise LayoutDescriptionError(f"{where}: unknown part {b.part!r} of {b.name}")
            limit = self.n_kv_heads if b.part == "k" else self.n_heads
            if not 0 <= b.head < limit:
                raise LayoutDescriptionError(
                    f"{where}: {b.part} head {b.head} of {b.name} is outside 0..{limit - 1}"
                )
            if b.rows < 1 or b.start < 0 or b.start + b.rows > b.param.shape[0]:
                raise LayoutDescriptionError(
                    f"{where}: rows {b.start}..{b.start + b.rows - 1} of {b.name} are outside "
                    f"its {b.param.shape[0]} rows (shape {tuple(b.param.shape)})"
                )
            spans.setdefault(id(b.param), []).append((b.start, b.start + b.rows, b.name))
            covered[b.part].add(b.head)
        for ranges in spans.values():
            ranges.sort()
            for (_, a1, name), (b0, _, _) in zip(ranges, ranges[1:], strict=False):
                if b0 < a1:
                    raise LayoutDescriptionError(f"{where}: overlapping row blocks in {name}")
        if covered["q"] != set(range(self.n_heads)):
            missing = sorted(set(range(self.n_heads)) - covered["q"])
            raise LayoutDescriptionError(f"{where}: query heads {missing} have no rows")
        if covered["k"] != set(range(self.n_kv_heads)):
            missing = sorted(set(range(self.n_kv_heads)) - covered["k"])
            raise LayoutDescriptionError(f"{where}: key heads {missing} have no rows")


def _rows(param: Tensor, name: str, expected: int, layer: str) -> None:
    if param.shape[0] != expected:
        raise LayoutDescriptionError(
            f"QK-Clip: attention {layer!r}: {name} has {param.shape[0]} rows (shape "
            f"{tuple(param.shape)}), expected {expected}"
        )


def separate_projections(
    name: str,
    q: tuple[str, Tensor],
    k: tuple[str, Tensor],
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    biases: Sequence[tuple[str, Tensor, str]] = (),
) -> AttentionHeads:
    """Separate query and key projections (``wq``: ``n_heads * head_dim`` rows, head-major;
    ``wk``: ``n_kv_heads * head_dim``). ``biases``: ``(name, bias, "q" or "k")`` of
    projections with a bias (gpt-oss), scaled with their weight's rows."""
    (q_name, wq), (k_name, wk) = q, k
    _rows(wq, q_name, n_heads * head_dim, name)
    _rows(wk, k_name, n_kv_heads * head_dim, name)
    blocks = [RowBlock(wq, q_name, "q", h, h * head_dim, head_dim) for h in range(n_heads)]
    blocks += [RowBlock(wk, k_name, "k", g, g * head_dim, head_dim) for g in range(n_kv_heads)]
    for b_name, bias, part in biases:
        heads = n_heads if part == "q" else n_kv_heads
        _rows(bias, b_name, heads * head_dim, name)
        blocks += [RowBlock(bias, b_name, part, h, h * head_dim, head_dim) for h in range(heads)]
    return AttentionHeads(name, n_heads, n_kv_heads, tuple(blocks))


def fused_qkv(
    name: str,
    qkv: tuple[str, Tensor],
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    order: str = "grouped",
    v_head_dim: int | None = None,
) -> AttentionHeads:
    """One weight (or bias) holding the query, key and value rows.

    ``order="grouped"``: per key head ``g``, its ``n_heads / n_kv_heads`` query heads, then
    its key, then its value (torchtitan 0.3's ``FusedQKVLinear``, Megatron's ``linear_qkv``);
    ``"stacked"``: all query heads, then all keys, then all values.
    """
    w_name, w = qkv
    v_dim = head_dim if v_head_dim is None else v_head_dim
    rep = n_heads // max(n_kv_heads, 1)
    _rows(w, w_name, n_heads * head_dim + n_kv_heads * (head_dim + v_dim), name)
    blocks: list[RowBlock] = []
    if order == "grouped":
        group_rows = rep * head_dim + head_dim + v_dim
        for g in range(n_kv_heads):
            base = g * group_rows
            for r in range(rep):
                blocks.append(RowBlock(w, w_name, "q", g * rep + r, base + r * head_dim, head_dim))
            blocks.append(RowBlock(w, w_name, "k", g, base + rep * head_dim, head_dim))
    elif order == "stacked":
        blocks += [RowBlock(w, w_name, "q", h, h * head_dim, head_dim) for h in range(n_heads)]
        k0 = n_heads * head_dim
        blocks += [
            RowBlock(w, w_name, "k", g, k0 + g * head_dim, head_dim) for g in range(n_kv_heads)
        ]
    else:
        raise LayoutDescriptionError(
            f"QK-Clip: attention {name!r}: fused order {order!r} is not 'grouped' or 'stacked'"
        )
    return AttentionHeads(name, n_heads, n_kv_heads, tuple(blocks))


def mla(
    name: str,
    q: tuple[str, Tensor],
    kv_b: tuple[str, Tensor],
    n_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> AttentionHeads:
    """Multi-head latent attention (DeepSeek-V3): ``q`` (``wq`` or ``wq_b``) has per head
    ``qk_nope_head_dim`` no-rope rows then ``qk_rope_head_dim`` rope rows; ``kv_b``
    (``wkv_b``) per head ``qk_nope_head_dim`` key rows then ``v_head_dim`` value rows. The
    rope key (in ``wkv_a``) is shared by all heads and is not described: it is never scaled."""
    (q_name, wq), (kv_name, wkv) = q, kv_b
    q_rows = qk_nope_head_dim + qk_rope_head_dim
    kv_rows = qk_nope_head_dim + v_head_dim
    _rows(wq, q_name, n_heads * q_rows, name)
    _rows(wkv, kv_name, n_heads * kv_rows, name)
    blocks: list[RowBlock] = []
    for h in range(n_heads):
        blocks.append(RowBlock(wq, q_name, "q", h, h * q_rows, qk_nope_head_dim))
        if qk_rope_head_dim:
            start = h * q_rows + qk_nope_head_dim
            blocks.append(RowBlock(wq, q_name, "q_rope", h, start, qk_rope_head_dim))
        blocks.append(RowBlock(wkv, kv_name, "k", h, h * kv_rows, qk_nope_head_dim))
    return AttentionHeads(name, n_heads, n_heads, tuple(blocks))
