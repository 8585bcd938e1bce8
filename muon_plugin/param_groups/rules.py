"""Which parameters Muon updates and which AdamW does: classification and param groups.

Pure functions over ``(name, parameter)`` pairs; nothing here needs torch.distributed.

Every trainable parameter gets exactly one *class*, from its name (the FQN with wrapper
prefixes ``_checkpoint_wrapped_module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.`` removed)
and its number of dimensions:

========== ================================================================ =========
class      default rule (first match wins, top to bottom)                   algorithm
========== ================================================================ =========
other      name ends in ``bias`` (any ndim, e.g. gpt_oss ``mlp1_bias`` [E, n]  adamw
           which is 2-D but not a matrix), or ndim == 0, or ndim > 3
norm       1-D whose module name contains ``norm`` (``attention_norm``,         adamw
           ``q_norm``, ``norm`` ...), or ``ln_*`` / ``layernorm``
other      any other 1-D parameter (``attention.sinks``, scales, ...)         adamw
embedding  2-D under a module named ``tok_embeddings``, ``embed_tokens``,        adamw
           ``wte``, ``wpe`` or ``*embed*``
output     2-D named ``output.weight`` or ``lm_head.weight`` (the head)      adamw
router     2-D under a ``router`` or ``gate`` module of an MoE block            adamw
           (``moe.router.gate.weight``): a tiny [experts, dim] matrix whose
           rows are scored against each other, kept on AdamW like most Muon
           recipes (Moonlight, Kimi K2) do; set ``router_algorithm = "muon"``
           to change it
expert     3-D (stacked expert matrices ``moe.experts.w1`` [E, m, n])           muon
matrix     any other 2-D parameter                                            muon
========== ================================================================ =========

A model with tied input/output embeddings (qwen3's small flavors) registers the shared tensor
once; ``named_parameters()`` returns it under its first name (``tok_embeddings.weight``), so it
is an *embedding*, counted once.

User patterns: for each class ``c`` a list ``c_patterns`` of patterns, matched against the
stripped FQN. A pattern is a shell-style glob (:mod:`fnmatch`, ``*`` also crosses dots:
``output.*``, ``layers.*.moe.router.*``) or, with the prefix ``re:``, a Python regular
expression that must match the whole name (``re:layers\\.[0-3]\\..*``). User patterns are
checked before the default rules; a parameter matched by patterns of two different classes is
an error, and so is a pattern that matches no parameter. A class without patterns keeps only
its default rule.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from muon_plugin.defaults import ALGORITHMS, NORMALIZATIONS
from muon_plugin.errors import SettingError

PARAM_CLASSES: tuple[str, ...] = (
    "matrix",
    "expert",
    "router",
    "embedding",
    "output",
    "norm",
    "other",
)
"""All parameter classes, in the order their groups are built and the table is printed."""

DEFAULT_ALGORITHMS: dict[str, str] = {
    "matrix": "muon",
    "expert": "muon",
    "router": "adamw",
    "embedding": "adamw",
    "output": "adamw",
    "norm": "adamw",
    "other": "adamw",
}

WRAPPER_PREFIXES: tuple[str, ...] = (
    "_checkpoint_wrapped_module.",
    "_orig_mod.",
    "_fsdp_wrapped_module.",
)

_EMBEDDING_MODULES = ("tok_embeddings", "embed_tokens", "wte", "wpe", "embeddings")
_OUTPUT_NAMES = ("output.weight", "lm_head.weight")

CLASS_OPTION_SUFFIXES: tuple[str, ...] = (
    "patterns",
    "algorithm",
    "lr",
    "weight_decay",
    "normalization",
)
"""The options every parameter class has (their types and help:
:mod:`muon_plugin.param_groups.class_options`)."""

CLASS_OPTIONS: tuple[str, ...] = tuple(
    f"{c}_{k}" for c in PARAM_CLASSES for k in CLASS_OPTION_SUFFIXES
)
"""The per-class options (``output_algorithm``, ...), as ``[optimizer.muon]`` and
:func:`muon_param_groups` name them."""


def is_number(x: Any) -> bool:
    """Whether ``x`` is an int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def invalid_value(
    section: str, key: str, value: Any, expected: str, kind: str = "option"
) -> SettingError:
    """The error for the setting ``key`` of ``section`` (``"optimizer.muon"``; ``""``: none)
    whose ``value`` is not what it must be."""
    where = f"{section}.{key}" if section else key
    return SettingError(key, f"invalid value {value!r}; expected {expected}", where, kind)


def option_error(prefix: str, key: str, problem: str) -> SettingError:
    """The error for the option ``key`` spelled with ``prefix`` (``"optimizer.muon."``)."""
    return SettingError(key, problem, f"{prefix}{key}", "option")


def strip_fqn(name: str) -> str:
    """``name`` without the wrapper components activation checkpointing, torch.compile and
    FSDP1 insert (wherever they appear, last included: a wrapped module's own name)."""
    name = f"{name}."
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name[:-1]


def _is_norm_module(module_name: str) -> bool:
    last = module_name.rsplit(".", 1)[-1].lower()
    return "norm" in last or last.startswith("ln_") or last in ("ln", "ln_f")


def default_class(name: str, ndim: int) -> str:
    """The class of a parameter under the default rules (see the module docstring)."""
    parts = name.split(".")
    leaf = parts[-1]
    module = ".".join(parts[:-1])
    modules = parts[:-1]
    if leaf.endswith("bias") or ndim == 0 or ndim > 3:
        return "other"
    if ndim == 1:
        return "norm" if _is_norm_module(module) else "other"
    if ndim == 2:
        if any(m in _EMBEDDING_MODULES or "embed" in m.lower() for m in modules):
            return "embedding"
        if name in _OUTPUT_NAMES:
            return "output"
        if "router" in modules or ("moe" in modules and "gate" in modules):
            return "router"
        return "matrix"
    # ndim == 3: a stack of matrices (MoE experts)
    return "expert"


class Pattern:
    """One user pattern: a glob, or a regex with the ``re:`` prefix."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"empty or non-string pattern {text!r}")
        self.text = text
        if text.startswith("re:"):
            try:
                self._regex = re.compile(text[3:])
            except re.error as e:
                raise ValueError(f"invalid regular expression in pattern {text!r}: {e}") from e
        else:
            self._regex = re.compile(fnmatch.translate(text))

    def matches(self, name: str) -> bool:
        return self._regex.fullmatch(name) is not None

    def __repr__(self) -> str:
        return repr(self.text)


@dataclass
class ClassSettings:
    """Per-class optimizer settings; ``None`` means "inherit the optimizer-wide value"."""

    algorithm: str
    lr: float | None = None
    weight_decay: float | None = None
    patterns: list[str] = field(default_factory=list)
    normalization: str | None = None
    """The Muon groups' ``normalization`` (``"none"``, ``"normuon"``); None: the optimizer's."""


@dataclass
class RuleSet:
    """User patterns and per-class settings. ``classes`` maps every class in
    :data:`PARAM_CLASSES` to its :class:`ClassSettings`."""

    classes: dict[str, ClassSettings]
    option_prefix: str = "optimizer.muon."
    """How option names are spelled in error messages."""

    @classmethod
    def default(cls) -> RuleSet:
        return cls({c: ClassSettings(DEFAULT_ALGORITHMS[c]) for c in PARAM_CLASSES})

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any], option_prefix: str = "optimizer.muon."
    ) -> RuleSet:
        """The rules of per-class options named as in ``[optimizer.muon]``
        (:data:`CLASS_OPTIONS`); a missing or None option keeps the class default."""
        classes = {}
        for c in PARAM_CLASSES:
            patterns = options.get(f"{c}_patterns") or []
            classes[c] = ClassSettings(
                algorithm=options.get(f"{c}_algorithm") or DEFAULT_ALGORITHMS[c],
                lr=options.get(f"{c}_lr"),
                weight_decay=options.get(f"{c}_weight_decay"),
                patterns=list(patterns) if isinstance(patterns, (list, tuple)) else patterns,
                normalization=options.get(f"{c}_normalization"),
            )
        return cls(classes, option_prefix=option_prefix)

    def __post_init__(self) -> None:
        unknown = set(self.classes) - set(PARAM_CLASSES)
        if unknown:
            raise ValueError(
                f"unknown parameter class(es) {sorted(unknown)}; expected {PARAM_CLASSES}"
            )
        for c in PARAM_CLASSES:
            self.classes.setdefault(c, ClassSettings(DEFAULT_ALGORITHMS[c]))
        for c, s in self.classes.items():
            self._check(c, s)

    def _check(self, c: str, s: ClassSettings) -> None:
        """Raise ValueError naming ``<prefix><c>_algorithm``, ``_patterns`` or
        ``_normalization`` when invalid."""
        section = self.option_prefix.rstrip(".")
        if s.algorithm not in ALGORITHMS:
            expected = "one of " + ", ".join(map(repr, ALGORITHMS))
            raise invalid_value(section, f"{c}_algorithm", s.algorithm, expected)
        if s.normalization is not None and s.normalization not in NORMALIZATIONS:
            expected = "one of " + ", ".join(map(repr, NORMALIZATIONS))
            raise invalid_value(section, f"{c}_normalization", s.normalization, expected)
        if s.normalization not in (None, "none") and s.algorithm != "muon":
            raise option_error(
                self.option_prefix,
                f"{c}_normalization",
                f"{s.normalization!r} but {c}_algorithm is {s.algorithm!r}: the normalization "
                "applies to Muon updates only",
            )
        if not isinstance(s.patterns, (list, tuple)):
            raise invalid_value(section, f"{c}_patterns", s.patterns, "a list of strings")
        for p in s.patterns:
            try:
                Pattern(p)
            except ValueError as e:
                raise option_error(self.option_prefix, f"{c}_patterns", str(e)) from None


@dataclass
class Classified:
    """The result of :func:`classify`: parameter FQNs (as given) and tensors per class."""

    names: dict[str, list[str]]
    params: dict[str, list[Any]]

    def class_of(self, name: str) -> str:
        for c, names in self.names.items():
            if name in names:
                return c
        raise KeyError(name)


def classify(
    named_params: Iterable[tuple[str, Any]],
    rules: RuleSet | None = None,
    *,
    used_patterns: set[tuple[str, str]] | None = None,
) -> Classified:
    """Assign every ``(name, param)`` a class. ``param`` only needs ``.ndim``.

    Raises ValueError naming the parameter when patterns of two classes match it. A user
    pattern that matches nothing is an error naming the pattern, unless ``used_patterns`` is
    given: then the ``(class, pattern)`` pairs that matched are added to it and the caller
    checks them with :func:`check_unused_patterns` after all model parts (with pipeline
    parallelism a pattern may match in one stage only).
    """
    rules = rules or RuleSet.default()
    compiled = {c: [Pattern(p) for p in rules.classes[c].patterns] for c in PARAM_CLASSES}
    used: set[tuple[str, str]] = set()
    names: dict[str, list[str]] = {c: [] for c in PARAM_CLASSES}
    params: dict[str, list[Any]] = {c: [] for c in PARAM_CLASSES}
    seen: set[int] = set()
    for name, p in named_params:
        if id(p) in seen:  # tied weights: keep the first name only
            continue
        seen.add(id(p))
        stripped = strip_fqn(name)
        hits = []
        for c in PARAM_CLASSES:
            for pat in compiled[c]:
                if pat.matches(stripped):
                    used.add((c, pat.text))
                    if c not in hits:
                        hits.append(c)
        if len(hits) > 1:
            raise option_error(
                rules.option_prefix,
                f"{hits[0]}_patterns",
                f"parameter {stripped!r} is matched by patterns of several classes: "
                + ", ".join(f"{c}_patterns" for c in hits),
            )
        cls = hits[0] if hits else default_class(stripped, p.ndim)
        names[cls].append(name)
        params[cls].append(p)
    if used_patterns is None:
        check_unused_patterns(rules, used)
    else:
        used_patterns.update(used)
    return Classified(names, params)


def check_unused_patterns(rules: RuleSet, used: set[tuple[str, str]]) -> None:
    """Raise ValueError naming the first user pattern not in ``used``."""
    for c in PARAM_CLASSES:
        for text in rules.classes[c].patterns:
            if (c, text) not in used:
                raise option_error(
                    rules.option_prefix,
                    f"{c}_patterns",
                    f"pattern {text!r} matches no parameter (names are matched without the "
                    "_orig_mod. / _checkpoint_wrapped_module. / _fsdp_wrapped_module. "
                    "components)",
                )
