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
``<class>_patterns``, ``<class>_algorithm``, ``<class>_lr``, ``<class>_weight_decay`` and
``<class>_normalization``.

Choices and defaults come from :mod:`muon_plugin.defaults` (a setting the optimizer has too
defaults to the optimizer's value, except ``lr_adjust``: the plugins'
:data:`~muon_plugin.defaults.PLUGIN_LR_ADJUST`); values are checked against the field types.
"""

# No "from __future__ import annotations": torchtitan 0.2.2 merges these dataclasses by their
# field types (make_dataclass + is_dataclass), which must be real classes, not strings.
import types
from dataclasses import dataclass, fields, make_dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from muon_plugin.defaults import (
    DEFAULTS,
    IMPLEMENTATIONS,
    LR_ADJUSTMENTS,
    NORMALIZATIONS,
    NORMUON_RESCALES,
    PLUGIN_IMPLEMENTATION,
    PLUGIN_LR_ADJUST,
    PLUGIN_STATE_DTYPE,
    QK_CLIP_ALPHA,
    QK_CLIP_GQA_RULE,
    QK_CLIP_GQA_RULES,
    SKIP_NONFINITE,
    STATE_DTYPES,
    STRATEGIES,
)
from muon_plugin.param_groups.class_options import choices, class_option_fields
from muon_plugin.param_groups.rules import RuleSet, invalid_value, is_number

_SECTION = "optimizer.muon"
_PREFIX = _SECTION + "."
_STRATEGY = DEFAULTS["orthogonalization_strategy"]
_NORMALIZATION = DEFAULTS["normalization"]
_RESCALE = DEFAULTS["normuon_rescale"]


@dataclass
class MuonOptions:
    """The options every parameter class shares; :class:`MuonConfig` adds the per-class ones."""

    implementation: choices(IMPLEMENTATIONS, PLUGIN_IMPLEMENTATION) = PLUGIN_IMPLEMENTATION
    """'foreach': MuonForeach, batches same-shape matrices (fast). 'per_param': Muon, one
    matrix at a time (reference)."""

    orthogonalization: choices(STRATEGIES, _STRATEGY) = _STRATEGY
    """Orthogonalization iteration: 'polar_express' (per-step optimal coefficients,
    arXiv:2505.16932), 'newton_schulz' (Muon's fixed quintic) or 'turbo_muon' (AOL row scaling
    from the first Gram matrix and its fitted quintics, arXiv:2512.04632; meant for ns_steps = 4;
    it approximates the polar factor of the row-scaled matrix, see docs/design/turbo_aol.md)."""

    ns_steps: int = DEFAULTS["ns_steps"]
    """Number of orthogonalization iterations."""

    momentum: float = DEFAULTS["momentum"]
    """Muon momentum coefficient, in [0, 1)."""

    nesterov: bool = DEFAULTS["nesterov"]
    """Use Nesterov momentum for the Muon groups."""

    cautious_weight_decay: bool = DEFAULTS["use_cautious_wd"]
    """Apply weight decay only where the update and the parameter agree in sign."""

    lr_adjust: choices(LR_ADJUSTMENTS, PLUGIN_LR_ADJUST) = PLUGIN_LR_ADJUST
    """Per-matrix learning-rate rule of the Muon groups: 'match_rms_adamw' scales by
    0.2*sqrt(max(rows, cols)) so an AdamW lr and weight decay carry over (Moonlight);
    'keller' by sqrt(max(1, rows/cols)); 'spectral' by sqrt(rows/cols); 'none' not at all."""

    flatten: bool = DEFAULTS["flatten"]
    """Treat >2-D parameters as (dim0, -1) matrices instead of batches of matrices (leave off
    for MoE experts)."""

    normalization: choices(NORMALIZATIONS, _NORMALIZATION) = _NORMALIZATION
    """Stage between the orthogonalization and the update of every Muon class (unless
    <class>_normalization says otherwise): 'none' (Muon) or 'normuon' (NorMuon,
    arXiv:2510.05491: each row of the orthogonalized update divided by the root of its running
    mean square, then the matrix rescaled; exact under every layout, one fp32 state entry per
    row)."""

    normuon_beta2: float = DEFAULTS["normuon_beta2"]
    """NorMuon: EMA coefficient of the per-row second moment, in [0, 1)."""

    normuon_eps: float = DEFAULTS["normuon_eps"]
    """NorMuon: added to the root of the per-row second moment."""

    normuon_rescale: choices(NORMUON_RESCALES, _RESCALE) = _RESCALE
    """NorMuon's rescale of each matrix (each row block of a fused weight): 'frobenius' keeps
    the Frobenius norm of Muon's update (the NorMuon authors' code); 'rms' gives the norm of an
    exactly orthogonal update under lr_adjust (the paper's rule: update RMS 0.2 with
    'match_rms_adamw')."""

    adam_beta1: float | None = None
    """beta1 of the Adam(W) groups; unset (None): optimizer.beta1."""

    adam_beta2: float | None = None
    """beta2 of the Adam(W) groups; unset (None): optimizer.beta2."""

    adam_eps: float | None = None
    """Epsilon of the Adam(W) groups; unset (None): optimizer.eps."""

    compile: bool = DEFAULTS["compile"]
    """torch.compile the orthogonalization."""

    backend: str = DEFAULTS["backend"]
    """Orthogonalization backend: 'auto' (the fastest exact-enough path per shape group:
    Triton symmetric kernels, Gram-space iteration, fp16 Q-form, CUDA graphs where they pay),
    'eager' (the same without CUDA graphs: less memory kept between steps on models of many
    small matrices, slower there), 'cublas' ('auto' without Triton kernels), 'plain' (the plain
    bf16 loop on torch matmuls, the reference), or a name registered with
    muon_plugin.orthogonalize.register_backend; ':no-<feature>' modifiers take features away,
    e.g. 'auto:no-gram,no-tma' (features: triton, gram, half, graphs, tma). The plan logged
    after the first step shows the backend and the path of every shape group."""

    skip_nonfinite: bool = SKIP_NONFINITE
    """Skip the update of a Muon matrix whose direction is not finite (a NaN/Inf gradient),
    keeping its weights and momentum, instead of writing NaNs into them; skips are counted and
    logged."""

    state_dtype: choices(STATE_DTYPES, PLUGIN_STATE_DTYPE) = PLUGIN_STATE_DTYPE
    """Dtype of the optimizer states: 'fp32' (Muon / MuonForeach); 'bf16', 'int8', 'int4',
    'fp8' select the low-precision MuonLP (needs torchao)."""

    block_size: int | None = None
    """Elements per quantization scale of the low-precision states (MuonLP only); unset
    (None): MuonLP's own, torchao's block size for the chosen state_dtype."""

    log_plan: bool = True
    """Log (rank 0) the param-group table at build time and the distributed orthogonalization
    plan after the first step."""

    qk_clip_tau: float | None = None
    """QK-Clip (MuonClip) threshold: after each optimizer step, every attention head whose
    largest pre-softmax logit of the step exceeded it has its query and key rows scaled so that
    logit becomes tau (Kimi K2: 100). Unset (None): off."""

    qk_clip_alpha: float = QK_CLIP_ALPHA
    """QK-Clip: a clipped head's query rows scale by gamma^alpha and its key rows by
    gamma^(1 - alpha), gamma = tau / max logit; in [0, 1]."""

    qk_clip_gqa: choices(QK_CLIP_GQA_RULES, QK_CLIP_GQA_RULE) = QK_CLIP_GQA_RULE
    """QK-Clip with grouped-query attention (a key head shared by several query heads):
    'query' scales each clipped query head by its own gamma and leaves the shared key rows
    alone; 'group' (Megatron) clips each key group by its largest logit, all its query heads
    by gamma^alpha and the key by gamma^(1 - alpha)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every value; errors name the key (``optimizer.muon.<key>``) and the value.

        Each option is checked against its field type (choices, flags, counts, numbers,
        pattern lists), then the per-class settings by :meth:`rules`.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            expected = option_problem(f.name, value, f.type)
            if expected is not None:
                raise invalid_value(_SECTION, f.name, value, expected)
        from muon_plugin.orthogonalize import backend_names, validate_backend

        try:
            validate_backend(self.backend)
        except ValueError as e:
            expected = "one of " + ", ".join(map(repr, backend_names()))
            if ":" in str(self.backend):
                expected += f", with modifiers such as 'auto:no-gram' ({e})"
            raise invalid_value(_SECTION, "backend", self.backend, expected) from None
        self.rules()

    def rules(self, option_prefix: str = _PREFIX) -> RuleSet:
        """The param-group rules these settings describe (errors spell the options with
        ``option_prefix``: a front end's section)."""
        return RuleSet.from_options(
            {f.name: getattr(self, f.name) for f in fields(self)}, option_prefix=option_prefix
        )


MuonConfig = make_dataclass(
    "MuonConfig",
    class_option_fields(),
    bases=(MuonOptions,),
    namespace={
        "__doc__": 'Muon optimizer (muon_plugin), used when optimizer.name = "muon".',
        "__module__": __name__,
    },
)
"""The ``[optimizer.muon]`` options: :class:`MuonOptions` and, per parameter class, the fields
of :data:`~muon_plugin.param_groups.class_options.CLASS_OPTION_TABLE` (generated, one table)."""


FRACTION_OPTIONS = ("momentum", "adam_beta1", "adam_beta2", "normuon_beta2")
"""Number options in [0, 1); every other number option must be >= 0 (or see below)."""

UNIT_INTERVAL_OPTIONS = ("qk_clip_alpha",)
"""Number options in [0, 1]."""

POSITIVE_OPTIONS = ("qk_clip_tau",)
"""Number options that must be finite and > 0."""


def option_problem(key: str, value: Any, option_type: Any) -> str | None:
    """What an option of ``option_type`` must be when ``value`` is not that; else None."""
    if get_origin(option_type) is Annotated:  # a generated field: its help is metadata
        option_type = get_args(option_type)[0]
    if get_origin(option_type) in (Union, types.UnionType):  # optional: None means "unset"
        if value is None:
            return None
        option_type = next(t for t in get_args(option_type) if t is not type(None))
    if get_origin(option_type) is Literal:
        allowed = get_args(option_type)
        return None if value in allowed else "one of " + ", ".join(map(repr, allowed))
    if get_origin(option_type) is list:
        return None if isinstance(value, (list, tuple)) else "a list of strings"
    if option_type is bool:
        return None if isinstance(value, bool) else "true or false"
    if option_type is str:
        return None if isinstance(value, str) else "a string"
    if option_type is int:
        ok = is_number(value) and isinstance(value, int) and value >= 1
        return None if ok else "a positive integer"
    if key in FRACTION_OPTIONS:
        return None if is_number(value) and 0.0 <= value < 1.0 else "a number in [0, 1)"
    if key in UNIT_INTERVAL_OPTIONS:
        return None if is_number(value) and 0.0 <= value <= 1.0 else "a number in [0, 1]"
    if key in POSITIVE_OPTIONS:
        ok = is_number(value) and 0 < value < float("inf")
        return None if ok else "a finite number > 0 (or unset)"
    return None if is_number(value) and value >= 0 else "a non-negative number"


JOB_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""Values of the job's ``optimizer.implementation`` (the Adam kernel of the AdamW groups)."""


def validate_optimizer_section(opt: Any, section: str = "optimizer") -> None:
    """:func:`validate_job_optimizer` on a front end's optimizer section (torchtitan's
    ``[optimizer]``, 0.3's container config): its ``lr``, ``weight_decay``, ``eps``, ``beta1``,
    ``beta2`` and ``implementation`` (``"fused"`` where it has none)."""
    validate_job_optimizer(
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        eps=opt.eps,
        beta1=opt.beta1,
        beta2=opt.beta2,
        implementation=getattr(opt, "implementation", "fused"),
        section=section,
    )


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
    for key, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not is_number(value) or not value >= 0 or value == float("inf"):
            raise invalid_value(section, key, value, "a finite number >= 0", "job")
    for key, value in (("beta1", beta1), ("beta2", beta2)):
        if not is_number(value) or not 0.0 <= value < 1.0:
            raise invalid_value(section, key, value, "a number in [0, 1)", "job")
    if implementation not in JOB_IMPLEMENTATIONS:
        expected = "one of " + ", ".join(map(repr, JOB_IMPLEMENTATIONS))
        raise invalid_value(section, "implementation", implementation, expected, "job")


MUON_CONFIG_KEYS = tuple(f.name for f in fields(MuonConfig))
