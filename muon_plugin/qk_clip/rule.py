"""The rule: per-head max logits ``S`` -> the factors the query / key / rope-query rows take.

For a head with ``S > tau`` (finite), ``gamma = tau / S``; its query rows scale by
``gamma^alpha``, its key rows by ``gamma^(1 - alpha)`` (so the head's logits, bilinear in q
and k, scale by ``gamma`` and the largest lands on ``tau``), MLA's rope-query rows by
``gamma`` (their key, shared by all heads, is left alone). Every other head gets factor 1.0
exactly, so its rows are bit-identical after the multiply: ``S <= tau`` (which includes every
``S <= 0``, since ``tau > 0``), ``S = -inf`` (no forward recorded) and non-finite ``S`` (NaN,
+inf: counted and reported, never applied). No division by a non-positive ``S`` ever happens.

Grouped-query attention (a key head shared by ``rep`` query heads):

- ``"query"``: query head ``h`` scales by its own ``gamma_h``, the shared key rows stay as they
  are. Exact per head (every clipped head lands on ``tau``, no other head moves), the same
  structure as MLA's shared rope key;
- ``"group"`` (Megatron): ``eta_g = tau / max_{h in g} S_h``; every query head of ``g`` scales
  by ``eta_g^alpha`` and the key by ``eta_g^(1 - alpha)``: the group's largest logit lands on
  ``tau`` and its other heads shrink by the same factor.

:class:`ClipRule` does this for all layers of a rank at once, from one flat ``S`` vector, with
index tensors built once; it never synchronizes with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from muon_plugin.defaults import QK_CLIP_GQA_RULES

__all__ = ["ClipRule", "LocalLayer"]


@dataclass(frozen=True)
class LocalLayer:
    """This rank's share of one attention layer: its query and key heads (after tensor
    parallelism) and whether it has MLA rope queries."""

    n_q: int
    n_kv: int
    rope_queries: bool = False

    @property
    def rep(self) -> int:
        return self.n_q // self.n_kv


class ClipRule:
    """Factors for every row part of every layer, from the flat per-query-head ``S``.

    The factor vector :meth:`factors` returns is laid out as ``[query heads | key heads |
    rope-query heads | 1.0]`` over the layers in order; :meth:`q_slot`, :meth:`k_slot`,
    :meth:`rope_slot` and :attr:`one_slot` index it.
    """

    def __init__(
        self,
        layers: Sequence[LocalLayer],
        tau: float,
        alpha: float,
        gqa_rule: str,
        device: torch.device | str = "cpu",
    ) -> None:
        if gqa_rule not in QK_CLIP_GQA_RULES:
            raise ValueError(f"QK-Clip: GQA rule {gqa_rule!r} is not one of {QK_CLIP_GQA_RULES}")
        if not (tau > 0 and tau != float("inf")):
            raise ValueError(f"QK-Clip: tau must be a finite number > 0, got {tau!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"QK-Clip: alpha must be in [0, 1], got {alpha!r}")
        self.layers = tuple(layers)
        self.tau = float(tau)
        self.alpha = float(alpha)
        self.gqa_rule = gqa_rule
        self.q_offsets: list[int] = []
        self.k_offsets: list[int] = []
        nq = nk = 0
        for layer in self.layers:
            if layer.n_q % layer.n_kv:
                raise ValueError(f"QK-Clip: {layer.n_q} local query heads, {layer.n_kv} key heads")
            self.q_offsets.append(nq)
            self.k_offsets.append(nk)
            nq += layer.n_q
            nk += layer.n_kv
        self.num_q, self.num_k = nq, nk
        self.one_slot = 2 * nq + nk
        width = max([layer.rep if self._grouped_rule(layer) else 1 for layer in self.layers] or [1])
        members = torch.full((nq, width), nq, dtype=torch.long)  # nq: the -inf sentinel
        q_exp = torch.empty(nq, dtype=torch.float32)
        k_src = torch.empty(nk, dtype=torch.long)
        k_exp = torch.empty(nk, dtype=torch.float32)
        for layer, q0, k0 in zip(self.layers, self.q_offsets, self.k_offsets, strict=True):
            rep = layer.rep
            for h in range(layer.n_q):
                g = h // rep
                if self._grouped_rule(layer):
                    members[q0 + h, :rep] = torch.arange(q0 + g * rep, q0 + (g + 1) * rep)
                else:
                    members[q0 + h, 0] = q0 + h
                shared_key = rep > 1 and self.gqa_rule == "query"
                q_exp[q0 + h] = 1.0 if shared_key else self.alpha
            for g in range(layer.n_kv):
                k_src[k0 + g] = q0 + g * rep
                k_exp[k0 + g] = 0.0 if (rep > 1 and self.gqa_rule == "query") else 1 - self.alpha
        self._members = members.to(device)
        self._q_exp = q_exp.to(device)
        self._k_src = k_src.to(device)
        self._k_exp = k_exp.to(device)
        self._sentinel = torch.full((1,), float("-inf"), device=device)
        self._one = torch.ones(1, device=device)

    def _grouped_rule(self, layer: LocalLayer) -> bool:
        return layer.rep > 1 and self.gqa_rule == "group"

    def q_slot(self, layer: int, head: int) -> int:
        """Factor index of local query head ``head`` of layer ``layer``."""
        return self.q_offsets[layer] + head

    def k_slot(self, layer: int, head: int) -> int:
        """Factor index of local key head ``head`` of layer ``layer``."""
        return self.num_q + self.k_offsets[layer] + head

    def rope_slot(self, layer: int, head: int) -> int:
        """Factor index of the rope-query rows of local head ``head`` of layer ``layer``."""
        return self.num_q + self.num_k + self.q_offsets[layer] + head

    def effective(self, s: Tensor) -> Tensor:
        """Per query head, the max logit its factor is computed from: its own, or (GQA
        ``"group"``) its key group's largest (NaN if any of the group's is NaN)."""
        padded = torch.cat([s.float(), self._sentinel])
        return padded[self._members].amax(dim=1)

    def gamma(self, s: Tensor) -> Tensor:
        """Per query head, ``tau / S_eff`` where that clips (``S_eff > tau``, finite), else 1."""
        eff = self.effective(s)
        clip = torch.isfinite(eff) & (eff > self.tau)
        return torch.where(clip, self.tau / torch.where(clip, eff, self.tau), 1.0)

    def factors(self, s: Tensor) -> Tensor:
        """The factor vector (see the class docstring) for the flat ``S``."""
        g = self.gamma(s)
        return torch.cat([g.pow(self._q_exp), g[self._k_src].pow(self._k_exp), g, self._one])

    def clipped(self, s: Tensor) -> Tensor:
        """Per query head: whether its rows are scaled (its factor is below 1)."""
        return self.gamma(s) < 1.0
