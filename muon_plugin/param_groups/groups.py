"""Param groups from the class rules: one group per non-empty parameter class.

:func:`build_param_groups` turns the classification of :mod:`muon_plugin.param_groups.rules`
into param groups for :class:`muon_plugin.Muon` (the adapter core builds every framework's
optimizers with it); :func:`muon_param_groups` is the same for plain PyTorch, from per-class
options named as in ``[optimizer.muon]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from muon_plugin.param_groups.rules import (
    CLASS_OPTIONS,
    PARAM_CLASSES,
    RuleSet,
    classify,
    is_number,
    option_error,
)

__all__ = ["build_param_groups", "muon_param_groups"]


def build_param_groups(
    named_params: Iterable[tuple[str, Any]],
    rules: RuleSet,
    *,
    lr: float,
    weight_decay: float,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
    used_patterns: set[tuple[str, str]] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Param groups for :class:`muon_plugin.Muon`: one per non-empty class.

    Each group: ``params``, ``param_names``, ``algorithm``, ``lr``, ``wd`` plus
    ``extra[algorithm]`` (e.g. ``{"adamw": {"adam_betas": ..., "adam_eps": ...}}``).
    Returns the groups and, in the same order, their class names.

    Raises ValueError when a class set to ``"muon"`` holds parameters with fewer than
    two dimensions. ``used_patterns``: see :func:`classify`.
    """
    classified = classify(named_params, rules, used_patterns=used_patterns)
    groups: list[dict[str, Any]] = []
    group_classes: list[str] = []
    for c in PARAM_CLASSES:
        ps = classified.params[c]
        if not ps:
            continue
        s = rules.classes[c]
        if s.algorithm == "muon":
            bad = [n for n, p in zip(classified.names[c], ps, strict=True) if p.ndim < 2]
            if bad:
                raise option_error(
                    rules.option_prefix,
                    f"{c}_algorithm",
                    f"'muon' but class {c!r} holds parameters with fewer than 2 dimensions, "
                    f"e.g. {bad[0]!r}; Muon only updates matrices",
                )
        group: dict[str, Any] = {
            "params": list(ps),
            "param_names": list(classified.names[c]),
            "algorithm": s.algorithm,
            "lr": lr if s.lr is None else s.lr,
            "wd": weight_decay if s.weight_decay is None else s.weight_decay,
        }
        if s.normalization is not None and s.algorithm == "muon":
            group["normalization"] = s.normalization
        if extra and s.algorithm in extra:
            group.update(extra[s.algorithm])
        groups.append(group)
        group_classes.append(c)
    return groups, group_classes


def muon_param_groups(
    model: Any,
    *,
    lr: float,
    weight_decay: float = 0.0,
    **options: Any,
) -> list[dict[str, Any]]:
    """Param groups for :class:`muon_plugin.Muon` by the plugin's rules, without torchtitan.

    ``model``: an ``nn.Module`` (its trainable ``named_parameters()``) or ``(name, param)``
    pairs. ``options``: per-class settings named as in ``[optimizer.muon]``
    (``output_algorithm="muon"``, ``norm_weight_decay=0.0``, ``embedding_lr=3e-3``,
    ``matrix_patterns=["layers.*"]``, ...). Matrices and expert stacks go to Muon; embeddings,
    the output head, routers, norms, biases and other vectors to AdamW (see the module
    docstring). Each group carries ``param_names`` (checkpoints match state by name).
    """
    unknown = sorted(set(options) - set(CLASS_OPTIONS))
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], CLASS_OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"muon_param_groups: unknown option {unknown[0]!r}{hint}; per-class options are "
            "<class>_patterns, <class>_algorithm, <class>_lr, <class>_weight_decay, "
            "<class>_normalization for class "
            f"in {PARAM_CLASSES}"
        )
    for key, value in (("lr", lr), ("weight_decay", weight_decay)):
        if not is_number(value) or not value >= 0:
            raise ValueError(f"muon_param_groups: {key} must be a number >= 0, got {value!r}")
    rules = RuleSet.from_options(options, option_prefix="")
    if hasattr(model, "named_parameters"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    else:
        named = list(model)
    groups, _ = build_param_groups(named, rules, lr=lr, weight_decay=weight_decay)
    return groups
