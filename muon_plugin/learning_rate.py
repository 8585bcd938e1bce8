"""The learning rate of a Muon parameter: its group's ``lr`` times Muon's shape rule.

The optimizer owns the whole learning rate, here and in the update stage:

- ``lr_adjust`` (:func:`lr_shape_factor`) multiplies the group's ``lr`` by a factor of each
  matrix's (or row block's) shape. The factor reaches the orthogonalization as the spec's
  ``output_scale`` (:class:`LrShapeRule`, set by :func:`muon_plugin.group_settings.group_spec`),
  which folds it into the iteration's last step at no cost; the orthogonalization knows it
  only as a factor of its result;
- the update stage (:func:`muon_plugin.functional.decay_and_update_`) applies the group's
  ``lr``: ``p -= lr * update``, and the decoupled weight decay ``lr * weight_decay``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from muon_plugin.defaults import LR_ADJUSTMENTS


def lr_shape_factor(rows: int, cols: int, rule: str) -> float:
    """The factor Muon's learning rate is multiplied by for a ``rows x cols`` matrix."""
    if rule == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(rows / cols)
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown lr_adjust {rule!r}; expected one of {LR_ADJUSTMENTS}")


@dataclass(frozen=True)
class LrShapeRule:
    """``lr_adjust`` as a spec's ``output_scale``: ``rule``'s factor for a ``rows x cols``
    matrix. Hashable and compared by value (specs key shape groups, and the ranks of a mesh
    compare their ``repr``)."""

    rule: str

    def __post_init__(self) -> None:
        if self.rule not in LR_ADJUSTMENTS:
            raise ValueError(f"unknown lr_adjust {self.rule!r}; expected one of {LR_ADJUSTMENTS}")

    def __call__(self, rows: int, cols: int) -> float:
        return lr_shape_factor(rows, cols, self.rule)
