"""The per-class options of ``[optimizer.muon]``, generated from one table.

Every parameter class (:data:`~muon_plugin.param_groups.rules.PARAM_CLASSES`) has the same five
options, ``<class>_patterns``, ``<class>_algorithm``, ``<class>_lr``, ``<class>_weight_decay``
and ``<class>_normalization``: :data:`CLASS_OPTION_TABLE` states each once (type, default, help
text), :data:`CLASS_DESCRIPTIONS` says what each class holds, and :func:`class_option_fields`
makes the dataclass fields :class:`~muon_plugin.param_groups.options.MuonConfig` adds. Each
field's help rides on its type (``Annotated[..., Doc(...)]``), which ``--help`` shows as it
shows the hand-written fields' docstrings.
"""

# No "from __future__ import annotations": the field types must be real objects (see options.py).
from dataclasses import field
from typing import Annotated, Any, Literal

from typing_extensions import Doc

from muon_plugin.defaults import ALGORITHMS, NORMALIZATIONS
from muon_plugin.param_groups.rules import (
    CLASS_OPTION_SUFFIXES,
    DEFAULT_ALGORITHMS,
    PARAM_CLASSES,
)

__all__ = ["CLASS_DESCRIPTIONS", "CLASS_OPTION_TABLE", "choices", "class_option_fields"]


def choices(allowed: tuple[str, ...], default: str | None = None) -> Any:
    """The ``Literal`` type of a choice option: ``allowed``, ``default`` first (as ``--help``
    lists them)."""
    first = () if default is None else (default,)
    return Literal[(*first, *(a for a in allowed if a != default))]


CLASS_DESCRIPTIONS: dict[str, str] = {
    "matrix": "2-D weight matrices (attention and MLP projections, shared experts)",
    "expert": "3-D stacks of MoE expert matrices ([experts, rows, cols])",
    "router": "MoE router / gate matrices (moe.router.gate.weight)",
    "embedding": "token embeddings (tok_embeddings.weight; also a tied output head)",
    "output": "the output head (output.weight, untied)",
    "norm": "normalization weights (attention_norm, ffn_norm, q_norm, norm ...)",
    "other": "biases, attention sinks, expert biases and other odd parameters",
}
"""What each parameter class holds (for the help texts)."""

CLASS_OPTION_TABLE: dict[str, tuple[Any, str]] = {
    "patterns": (
        list[str],
        'Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the '
        "'{cls}' class ({description}), checked before the default rules; a pattern matching "
        "nothing is an error.",
    ),
    "algorithm": (
        choices(ALGORITHMS) | None,
        "Algorithm of the '{cls}' class; unset (None): {algorithm}.",
    ),
    "lr": (float | None, "Learning rate of the '{cls}' class; unset (None): optimizer.lr."),
    "weight_decay": (
        float | None,
        "Weight decay of the '{cls}' class; unset (None): optimizer.weight_decay.",
    ),
    "normalization": (
        choices(NORMALIZATIONS) | None,
        "Normalization of the '{cls}' class when it runs Muon ('none' or 'normuon'); unset "
        "(None): optimizer.muon.normalization.",
    ),
}
"""Per option suffix: its type and help text (``{cls}``, ``{description}`` and ``{algorithm}``,
the class default, filled in per class). Patterns default to an empty list, the rest to None
(the class default)."""

assert tuple(CLASS_OPTION_TABLE) == CLASS_OPTION_SUFFIXES, "one table of per-class options"


def class_option_fields() -> list[tuple[str, Any, Any]]:
    """``(name, type, field)`` of every per-class option, class by class, for
    ``dataclasses.make_dataclass``."""
    out = []
    for cls in PARAM_CLASSES:
        for suffix, (option_type, text) in CLASS_OPTION_TABLE.items():
            help_text = text.format(
                cls=cls, description=CLASS_DESCRIPTIONS[cls], algorithm=DEFAULT_ALGORITHMS[cls]
            )
            default = field(default_factory=list) if suffix == "patterns" else field(default=None)
            out.append((f"{cls}_{suffix}", Annotated[option_type, Doc(help_text)], default))
    return out
