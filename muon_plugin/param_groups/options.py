"""The ``[optimizer.muon]`` options: one schema (fields, choices, defaults, docs) for every adapter.

:class:`MuonConfig` is what a job's ``[optimizer.muon]`` table holds, on any torchtitan release
(and in any other front end). Nothing here imports torchtitan. Example TOML::

    [optimizer.muon]
    orthogonalization = "polar_express"
    ns_steps = 5
    norm_weight_decay = 0.0
    embedding_lr = 3e-3
    output_patterns = ["output.*"]

Every field can be overridden on the command line (``--optimizer.muon.ns_steps 7``,
``--optimizer.muon.no-nesterov``, lists as ``a,b,c``) and is listed, with its docstring, by
``--help``. The job's own optimizer fields keep their meaning: ``lr`` and ``weight_decay`` are
the defaults of every parameter class, ``beta1``/``beta2``/``eps`` those of the AdamW groups.

Parameter classes (see :mod:`muon_plugin.param_groups.rules` for the default rules): ``matrix``,
``expert``, ``router``, ``embedding``, ``output``, ``norm``, ``other``; each has
``<class>_patterns``, ``<class>_algorithm``, ``<class>_lr`` and ``<class>_weight_decay``.
"""

# No "from __future__ import annotations": torchtitan 0.2.2 merges these dataclasses by their
# field types (make_dataclass + is_dataclass), which must be real classes, not strings.
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from muon_plugin.defaults import IMPLEMENTATIONS, LR_ADJUSTMENTS, STATE_DTYPES, STRATEGIES
from muon_plugin.param_groups.rules import (
    ALGORITHMS,
    PARAM_CLASSES,
    ClassSettings,
    Pattern,
    RuleSet,
)

ORTHOGONALIZATIONS = STRATEGIES
LR_ADJUSTS = LR_ADJUSTMENTS

_PREFIX = "optimizer.muon."


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{_PREFIX}{key}: invalid value {value!r}; expected {expected}")


@dataclass
class MuonConfig:
    """Muon optimizer (muon_plugin), used when optimizer.name = "muon"."""

    implementation: Literal["foreach", "per_param"] = "foreach"
    """'foreach': MuonForeach, batches same-shape matrices (fast). 'per_param': Muon, one
    matrix at a time (reference)."""

    orthogonalization: Literal["polar_express", "newton_schulz"] = "polar_express"
    """Orthogonalization iteration: 'polar_express' (per-step optimal coefficients,
    arXiv:2505.16932) or 'newton_schulz' (Muon's fixed quintic)."""

    ns_steps: int = 5
    """Number of orthogonalization iterations."""

    momentum: float = 0.95
    """Muon momentum coefficient, in [0, 1)."""

    nesterov: bool = True
    """Use Nesterov momentum for the Muon groups."""

    cautious_weight_decay: bool = True
    """Apply weight decay only where the update and the parameter agree in sign."""

    lr_adjust: Literal["match_rms_adamw", "keller", "spectral", "none"] = "match_rms_adamw"
    """Per-matrix learning-rate rule of the Muon groups: 'match_rms_adamw' scales by
    0.2*sqrt(max(rows, cols)) so an AdamW lr and weight decay carry over (Moonlight);
    'keller' by sqrt(max(1, rows/cols)); 'spectral' by sqrt(rows/cols); 'none' not at all."""

    flatten: bool = False
    """Treat >2-D parameters as (dim0, -1) matrices instead of batches of matrices (leave off
    for MoE experts)."""

    adam_beta1: float | None = None
    """beta1 of the Adam(W) groups; unset (None): optimizer.beta1."""

    adam_beta2: float | None = None
    """beta2 of the Adam(W) groups; unset (None): optimizer.beta2."""

    adam_eps: float | None = None
    """Epsilon of the Adam(W) groups; unset (None): optimizer.eps."""

    compile: bool = False
    """torch.compile the orthogonalization."""

    skip_nonfinite: bool = False
    """Skip the update of a Muon matrix whose direction is not finite (a NaN/Inf gradient),
    keeping its weights and momentum, instead of writing NaNs into them; skips are counted and
    logged."""

    state_dtype: Literal["fp32", "bf16", "int8", "int4", "fp8"] = "fp32"
    """Dtype of the optimizer states: 'fp32' (Muon / MuonForeach); 'bf16', 'int8', 'int4',
    'fp8' select the low-precision MuonLP (needs torchao)."""

    block_size: int | None = None
    """Elements per quantization scale of the low-precision states (MuonLP only); unset
    (None): MuonLP's own, torchao's block size for the chosen state_dtype."""

    log_plan: bool = True
    """Log (rank 0) the param-group table at build time and the distributed orthogonalization
    plan after the first step."""

    # --- matrix: 2-D weight matrices (attention and MLP projections, shared experts)
    matrix_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'matrix'
    class, checked before the default rules; a pattern matching nothing is an error."""

    matrix_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'matrix' class; unset (None): muon."""

    matrix_lr: float | None = None
    """Learning rate of the 'matrix' class; unset (None): optimizer.lr."""

    matrix_weight_decay: float | None = None
    """Weight decay of the 'matrix' class; unset (None): optimizer.weight_decay."""

    # --- expert: 3-D stacks of MoE expert matrices ([experts, rows, cols])
    expert_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'expert'
    class, checked before the default rules; a pattern matching nothing is an error."""

    expert_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'expert' class; unset (None): muon."""

    expert_lr: float | None = None
    """Learning rate of the 'expert' class; unset (None): optimizer.lr."""

    expert_weight_decay: float | None = None
    """Weight decay of the 'expert' class; unset (None): optimizer.weight_decay."""

    # --- router: MoE router / gate matrices (moe.router.gate.weight)
    router_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'router'
    class, checked before the default rules; a pattern matching nothing is an error."""

    router_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'router' class; unset (None): adamw."""

    router_lr: float | None = None
    """Learning rate of the 'router' class; unset (None): optimizer.lr."""

    router_weight_decay: float | None = None
    """Weight decay of the 'router' class; unset (None): optimizer.weight_decay."""

    # --- embedding: token embeddings (tok_embeddings.weight; also a tied output head)
    embedding_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'embedding'
    class, checked before the default rules; a pattern matching nothing is an error."""

    embedding_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'embedding' class; unset (None): adamw."""

    embedding_lr: float | None = None
    """Learning rate of the 'embedding' class; unset (None): optimizer.lr."""

    embedding_weight_decay: float | None = None
    """Weight decay of the 'embedding' class; unset (None): optimizer.weight_decay."""

    # --- output: the output head (output.weight, untied)
    output_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'output'
    class, checked before the default rules; a pattern matching nothing is an error."""

    output_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'output' class; unset (None): adamw."""

    output_lr: float | None = None
    """Learning rate of the 'output' class; unset (None): optimizer.lr."""

    output_weight_decay: float | None = None
    """Weight decay of the 'output' class; unset (None): optimizer.weight_decay."""

    # --- norm: normalization weights (attention_norm, ffn_norm, q_norm, norm ...)
    norm_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'norm'
    class, checked before the default rules; a pattern matching nothing is an error."""

    norm_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'norm' class; unset (None): adamw."""

    norm_lr: float | None = None
    """Learning rate of the 'norm' class; unset (None): optimizer.lr."""

    norm_weight_decay: float | None = None
    """Weight decay of the 'norm' class; unset (None): optimizer.weight_decay."""

    # --- other: biases, attention sinks, expert biases and other odd parameters
    other_patterns: list[str] = field(default_factory=list)
    """Patterns (glob, or regex with prefix "re:") of parameter FQNs to put in the 'other'
    class, checked before the default rules; a pattern matching nothing is an error."""

    other_algorithm: Literal["muon", "adamw", "adam"] | None = None
    """Algorithm of the 'other' class; unset (None): adamw."""

    other_lr: float | None = None
    """Learning rate of the 'other' class; unset (None): optimizer.lr."""

    other_weight_decay: float | None = None
    """Weight decay of the 'other' class; unset (None): optimizer.weight_decay."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every value; errors name the key (``optimizer.muon.<key>``) and the value."""
        choices = {
            "implementation": IMPLEMENTATIONS,
            "orthogonalization": ORTHOGONALIZATIONS,
            "lr_adjust": LR_ADJUSTS,
            "state_dtype": STATE_DTYPES,
        }
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value not in allowed:
                raise _bad(key, value, "one of " + ", ".join(repr(a) for a in allowed))
        for key in (
            "nesterov",
            "cautious_weight_decay",
            "compile",
            "log_plan",
            "flatten",
            "skip_nonfinite",
        ):
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, getattr(self, key), "true or false")
        for key in ("ns_steps", "block_size"):
            value = getattr(self, key)
            if value is None and key == "block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(key, value, "a positive integer")
        if not _is_number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise _bad("momentum", self.momentum, "a number in [0, 1)")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            if value is not None and (not _is_number(value) or not 0.0 <= value < 1.0):
                raise _bad(key, value, "a number in [0, 1)")
        if self.adam_eps is not None and (not _is_number(self.adam_eps) or not self.adam_eps >= 0):
            raise _bad("adam_eps", self.adam_eps, "a non-negative number")
        for c in PARAM_CLASSES:
            algorithm = getattr(self, f"{c}_algorithm")
            if algorithm is not None and algorithm not in ALGORITHMS:
                raise _bad(
                    f"{c}_algorithm", algorithm, "one of " + ", ".join(map(repr, ALGORITHMS))
                )
            for key in (f"{c}_lr", f"{c}_weight_decay"):
                value = getattr(self, key)
                if value is not None and (not _is_number(value) or not value >= 0):
                    raise _bad(key, value, "a non-negative number")
            patterns = getattr(self, f"{c}_patterns")
            if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
                raise _bad(f"{c}_patterns", patterns, "a list of strings")
            for p in patterns:
                try:
                    Pattern(p)
                except ValueError as e:
                    raise ValueError(f"{_PREFIX}{c}_patterns: {e}") from None

    def rules(self) -> RuleSet:
        """The param-group rules these settings describe."""
        from muon_plugin.param_groups.rules import DEFAULT_ALGORITHMS

        return RuleSet(
            {
                c: ClassSettings(
                    algorithm=getattr(self, f"{c}_algorithm") or DEFAULT_ALGORITHMS[c],
                    lr=getattr(self, f"{c}_lr"),
                    weight_decay=getattr(self, f"{c}_weight_decay"),
                    patterns=list(getattr(self, f"{c}_patterns")),
                )
                for c in PARAM_CLASSES
            },
            option_prefix=_PREFIX,
        )


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


JOB_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""Values of the job's ``optimizer.implementation`` (the Adam kernel of the AdamW groups)."""


def validate_job_optimizer(
    *,
    lr: Any,
    weight_decay: Any,
    eps: Any,
    beta1: Any,
    beta2: Any,
    implementation: Any = "fused",
    section: str = "optimizer",
) -> None:
    """Check the job-wide optimizer settings Muon groups are built from.

    These are the front end's own fields (torchtitan's ``[optimizer]``), which it does not
    check itself; errors name the key as ``section.field`` and the value.
    """

    def bad(key: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"{section}.{key}: invalid value {value!r}; expected {expected}")

    for key, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not _is_number(value) or not value >= 0 or value == float("inf"):
            raise bad(key, value, "a finite number >= 0")
    for key, value in (("beta1", beta1), ("beta2", beta2)):
        if not _is_number(value) or not 0.0 <= value < 1.0:
            raise bad(key, value, "a number in [0, 1)")
    if implementation not in JOB_IMPLEMENTATIONS:
        raise bad(
            "implementation", implementation, "one of " + ", ".join(map(repr, JOB_IMPLEMENTATIONS))
        )


MUON_CONFIG_KEYS = tuple(f.name for f in fields(MuonConfig))
