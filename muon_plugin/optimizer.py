"""``Muon`` and ``MuonForeach``: Muon on matrices and Adam/AdamW on the rest, in one optimizer.

Each param group picks its algorithm with the ``"algorithm"`` key (``"muon"`` default,
``"adamw"``, ``"adam"``). A step:

1. Adam groups run ``torch.optim``'s own functional Adam (fused where asked).
2. Muon groups run :func:`muon_plugin.functional.muon` on the local shards of every Muon
   parameter with a gradient: momentum, orthogonalization through one cached
   :class:`~muon_plugin.distributed.plan.OrthogonalizationPlan` (which assembles whole
   matrices, orthogonalizes them and returns the local shards; cached by
   :class:`~muon_plugin.plan_cache.PlanCache`), weight decay and update.

The classes are drivers: they gather the lists from param groups and state, create the state,
cache the plan, and keep their configuration through copies
(:class:`~muon_plugin.copies.CopyableOptimizer`) and checkpoints (:mod:`muon_plugin.state_dict`).
``Muon`` runs the elementwise math and the orthogonalization matrix by matrix; ``MuonForeach``
runs the same math on whole groups with ``torch._foreach_*`` and stacks same-shape matrices
into one batched orthogonalization. Parameters may be plain tensors or DTensors (FSDP2, TP).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from muon_plugin import functional
from muon_plugin.adam import adam_step
from muon_plugin.copies import CopyableOptimizer
from muon_plugin.defaults import DEFAULTS, SKIP_NONFINITE
from muon_plugin.functional import BUFFERS, MomentumStorage, momentum_dtype
from muon_plugin.group_settings import group_settings, group_spec
from muon_plugin.kernels.tuning_cache import read_tuning_settings
from muon_plugin.orthogonalize import MatrixSpec, environment_overrides
from muon_plugin.parameters import local
from muon_plugin.plan_cache import PlanCache
from muon_plugin.row_state import (
    ROW_STATE_KEY,
    CheckedRows,
    group_row_states,
    restore_row_state,
)
from muon_plugin.state_dict import (
    check_group_sizes,
    fill_missing_settings,
    hold_out_momentum,
    match_by_name,
    place_fused_adam_steps,
    positions,
    restore_momentum,
    warn_missing_state,
)
from muon_plugin.validation import (
    NUMBER_KEYS,
    check_grad_layouts,
    check_group_keys,
    check_unique_params,
    normalize_group,
    resolve_synonyms,
    validate_group,
    validate_number,
)

__all__ = ["Muon", "MuonForeach"]


class Muon(CopyableOptimizer):
    """Muon for matrix params, Adam/AdamW for the rest; see the module docstring.

    Args:
        params: parameters or param groups (``named_parameters()`` works and improves errors).
        lr: learning rate (a float or a one-element Tensor). Muon groups scale it per matrix
            by ``lr_adjust``.
        wd: decoupled weight decay, applied with the group ``lr`` (default 0.1).
        use_cautious_wd: decay only where the update and the parameter agree in sign.
        momentum, nesterov: Muon's momentum (fp32 buffers for bf16/fp16 parameters).
        ns_steps, orthogonalization_strategy: iteration count and ``"polar_express"``,
            ``"newton_schulz"`` or ``"turbo_muon"`` (AOL row scaling, meant for 4 steps).
        ns_coefficients: one fixed quintic ``(a, b, c)`` for every step instead of the
            strategy's schedule (torch.optim.Muon's option; default None).
        ns_eps: lower bound on the norm the input is divided by (default 1e-7).
        adam_betas, adam_eps, is_adamw, fused_adam: the Adam path (``is_adamw=False`` couples
            weight decay into the gradient).
        compile: ``torch.compile`` the orthogonalization.
        lr_adjust: Muon's shape rule (default ``"keller"``): ``"keller"``
            ``sqrt(max(1, rows/cols))``, ``"match_rms_adamw"`` ``0.2*sqrt(max(rows, cols))``,
            ``"spectral"`` ``sqrt(rows/cols)``, ``"none"``.
        flatten: treat >2-D params as ``(dim0, -1)`` matrices instead of batches of matrices.
        split_sizes: row blocks of fused weights (e.g. QKV) orthogonalized independently.
        replicate_group: process group (or 1-D mesh) that plain-tensor parameters are
            replicated over (DDP); their orthogonalization is then split over its ranks instead
            of repeated on each. DTensor parameters (FSDP2, TP, HSDP) need nothing. Not
            picklable: a pickled optimizer comes back without it (every rank then
            orthogonalizes its replicated matrices itself: the same updates, more work;
            set the attribute again to split the work); ``copy.deepcopy`` keeps it.
        normalization: ``"none"`` (Muon) or ``"normuon"``: NorMuon (arXiv:2510.05491), each row
            of the orthogonalized update divided by the root of its running mean square, then
            the matrix rescaled (each row block of ``split_sizes`` on its own), on the rank
            that orthogonalized it. Extra state: one fp32 entry per row
            (``"normuon_second_moment"``), laid out like the parameter's rows.
        normuon_beta2: the per-row second moment's EMA coefficient (default 0.95).
        normuon_eps: added to the root of the second moment (default 1e-8).
        normuon_rescale: ``"frobenius"`` (default) keeps the Frobenius norm of Muon's update
            (the NorMuon authors' code); ``"rms"`` gives the norm of an exactly orthogonal
            update under ``lr_adjust`` (the paper's rule; an update RMS of 0.2 with
            ``"match_rms_adamw"``).
        skip_nonfinite: skip the update of every Muon matrix whose orthogonalized direction
            is non-finite (a NaN/Inf gradient or momentum): its weights and momentum stay as
            they were. ``skipped_updates`` counts, on this rank, the Muon parameters with a
            skipped matrix, cumulatively. Off by default (then it costs nothing).
        weight_decay, adjust_lr_fn, eps: torch.optim.Muon's names for ``wd``, ``lr_adjust``
            (``"original"`` is ``"keller"``) and ``ns_eps``; giving both names of one setting
            is an error. Param groups accept them too (``eps`` is ``adam_eps`` in Adam/AdamW
            groups, and ``betas`` is ``adam_betas``).

    Copies: ``copy.deepcopy`` and pickling keep the configuration, the state and the
    ``skipped_updates`` count; caches derived from them (the plan) are rebuilt at the next
    step.
    """

    batched = False
    """Run stages 1 and 3 on whole groups and stack same-shape orthogonalizations."""

    config_attributes: tuple[str, ...] = (
        "replicate_group",
        "skip_nonfinite",
        "skipped_updates",
        "backend_overrides",
    )
    backend_overrides: frozenset[str] = frozenset()
    """The features the environment switched off when this optimizer was built
    (:func:`~muon_plugin.orthogonalize.environment_overrides`), folded into every group's
    backend name."""
    shared_attributes: tuple[str, ...] = ("replicate_group",)

    momentum_state_keys: tuple[str, ...] = ("momentum_buffer",)
    """State keys that hold Muon momentum (MuonLP stores codes and scales instead)."""
    momentum_storage: MomentumStorage = BUFFERS
    """How the momentum states :meth:`_momentum_states` returns are updated (stage 1)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = DEFAULTS["lr"],
        wd: float | None = None,
        use_cautious_wd: bool = DEFAULTS["use_cautious_wd"],
        momentum: float = DEFAULTS["momentum"],
        nesterov: bool = DEFAULTS["nesterov"],
        ns_steps: int = DEFAULTS["ns_steps"],
        orthogonalization_strategy: str = DEFAULTS["orthogonalization_strategy"],
        adam_betas: tuple[float, float] = DEFAULTS["adam_betas"],
        adam_eps: float = DEFAULTS["adam_eps"],
        is_adamw: bool = DEFAULTS["is_adamw"],
        fused_adam: bool = DEFAULTS["fused_adam"],
        compile: bool = DEFAULTS["compile"],
        lr_adjust: str | None = None,
        flatten: bool = DEFAULTS["flatten"],
        split_sizes: tuple[int, ...] | None = DEFAULTS["split_sizes"],
        replicate_group: Any = None,
        *,
        ns_coefficients: tuple[float, float, float] | None = DEFAULTS["ns_coefficients"],
        ns_eps: float | None = None,
        backend: str = DEFAULTS["backend"],
        normalization: str = DEFAULTS["normalization"],
        normuon_beta2: float = DEFAULTS["normuon_beta2"],
        normuon_eps: float = DEFAULTS["normuon_eps"],
        normuon_rescale: str = DEFAULTS["normuon_rescale"],
        skip_nonfinite: bool = SKIP_NONFINITE,
        weight_decay: float | None = None,
        adjust_lr_fn: str | None = None,
        eps: float | None = None,
    ) -> None:
        # Settings that have a torch.optim name: None means "not given" under that name.
        named = {
            k: v
            for k, v in (
                ("wd", wd),
                ("lr_adjust", lr_adjust),
                ("ns_eps", ns_eps),
                ("weight_decay", weight_decay),
                ("adjust_lr_fn", adjust_lr_fn),
                ("eps", eps),
            )
            if v is not None
        }
        named = resolve_synonyms(named, "optimizer arguments")
        defaults = dict(
            DEFAULTS,
            lr=lr,
            use_cautious_wd=use_cautious_wd,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            orthogonalization_strategy=orthogonalization_strategy,
            adam_betas=adam_betas,
            adam_eps=adam_eps,
            is_adamw=is_adamw,
            fused_adam=fused_adam,
            compile=compile,
            flatten=flatten,
            split_sizes=split_sizes,
            ns_coefficients=ns_coefficients,
            backend=backend,
            normalization=normalization,
            normuon_beta2=normuon_beta2,
            normuon_eps=normuon_eps,
            normuon_rescale=normuon_rescale,
            **named,
        )
        self._plans = PlanCache()
        self._checked_rows: CheckedRows = {}
        self.replicate_group = replicate_group
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_updates = 0
        # Read once: nothing reads the environment while a step runs.
        self.backend_overrides = environment_overrides()
        read_tuning_settings()
        for key in NUMBER_KEYS:  # before the params are read, as torch.optim does
            validate_number(key, defaults[key])
        super().__init__(params, defaults)

    def _rebuild_caches(self) -> None:
        """Rebuild what derives from the param groups after a copy (subclasses extend this)."""
        self._forget_plan()
        self._checked_rows = {}

    def _forget_plan(self) -> None:
        """Drop the cached plan: the next step builds it again."""
        self._plans = PlanCache()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its keys, values and parameters (errors name them)."""
        index = len(self.param_groups)
        param_group = resolve_synonyms(param_group, f"param group {index}")
        check_group_keys(param_group, index)
        with warnings.catch_warnings():  # refused below, naming the parameter
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        group = self.param_groups[-1]
        normalize_group(group)
        try:
            check_unique_params(group, index)
            validate_group(group)
        except ValueError:
            self.param_groups.pop()
            raise

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step; ``closure`` re-evaluates the loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_groups = []
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                muon_groups.append(group)
            else:
                adam_step(group, self.state, foreach=self.batched)
        if muon_groups:
            self._muon_step(muon_groups)
        return loss

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        """Gather the Muon parameters with gradients and run the functional core on them."""
        params: list[Tensor] = []
        specs: list[MatrixSpec] = []
        settings: list[functional.GroupSettings] = []
        momenta: list[Any] = []
        rows: list[Tensor | None] = []
        for group in groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            check_grad_layouts(group, ps)
            spec = group_spec(group, self.backend_overrides)
            params += ps
            specs += [spec] * len(ps)
            settings.append(group_settings(group, len(ps), self.backend_overrides))
            momenta += self._momentum_states(group, ps)
            rows += group_row_states(self.state, group, ps, spec, self._checked_rows)
        if not params:
            return
        skipped = functional.muon(
            [local(p) for p in params],
            [local(p.grad) for p in params],
            momenta,
            settings,
            self._plans.get(
                params,
                specs,
                self.param_groups,
                batched=self.batched,
                replicate_group=self.replicate_group,
            ),
            foreach=self.batched,
            skip_nonfinite=self.skip_nonfinite,
            storage=self.momentum_storage,
            second_moments=rows if any(r is not None for r in rows) else None,
        )
        self.skipped_updates += len(skipped)

    def _momentum_states(self, group: dict[str, Any], ps: list[Tensor]) -> list[Any]:
        """The momentum of ``ps`` (Muon params with grads) as :attr:`momentum_storage` takes
        it, created (zero) if missing: here the local momentum buffers."""
        return [local(self._momentum_buffer(p)) for p in ps]

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            dtype = momentum_dtype(p.dtype)
            buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["momentum_buffer"] = buf
        return buf

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like ``torch.optim``, but by name, checked, and keeping the momentum's format.

        - When every saved and every live group carries ``param_names``, state is matched by
          name (a parameter may sit at another position, or in another group); a name on one
          side only is an error naming it. Otherwise it is matched by position, as torch does.
          Group settings always come from the saved group at the same position.
        - Every entry is checked against its parameter at load: a tensor of another shape, or
          of a non-floating dtype (a real one for a complex parameter), is an error naming the
          parameter and the key.
        - ``torch.optim`` casts every floating state tensor to its parameter's dtype, which
          would turn the fp32 momentum of bf16 parameters into bf16 (and MuonLP's codes into
          floats). Momentum entries are held out of that cast and restored by
          ``_restore_momentum``; NorMuon's per-row state likewise (fp32, laid out like its
          parameter's rows; its shape is checked against the parameter's rows).
        """
        state_dict = match_by_name(state_dict, self.param_groups)
        check_group_sizes(state_dict["param_groups"], self.param_groups)
        where = positions(self.param_groups)
        state_dict, held = hold_out_momentum(
            state_dict, self.param_groups, (*self.momentum_state_keys, ROW_STATE_KEY)
        )
        super().load_state_dict(state_dict)
        fill_missing_settings(self.param_groups, self.defaults)
        restore_momentum(
            held, where, self.state, lambda p, saved: self._restore_held(p, saved, where)
        )
        warn_missing_state(self.param_groups, self.state)
        place_fused_adam_steps(self.param_groups, self.state)
        self._forget_plan()

    def _restore_held(
        self, p: Tensor, saved: dict[str, Tensor], where: dict[int, tuple[Any, int]]
    ) -> dict[str, Tensor]:
        """Held-out entries of ``p``: its momentum (:meth:`_restore_momentum`) and its NorMuon
        per-row state (fp32, laid out like ``p``'s rows; ``where``: the params' positions)."""
        momentum = {k: v for k, v in saved.items() if k != ROW_STATE_KEY}
        out = self._restore_momentum(p, momentum) if momentum else {}
        if ROW_STATE_KEY in saved:
            group = where[id(p)][0]
            out[ROW_STATE_KEY] = restore_row_state(p, saved[ROW_STATE_KEY], group_spec(group))
        return out

    def _restore_momentum(self, p: Tensor, saved: dict[str, Tensor]) -> dict[str, Tensor]:
        """Loaded momentum entries of ``p`` in this optimizer's dtype, on ``p``'s device."""
        return {k: v.to(dtype=momentum_dtype(p.dtype), device=p.device) for k, v in saved.items()}

    # ------------------------------------------------------------------ reporting

    def plan_report(self) -> list[dict[str, Any]]:
        """The distributed orthogonalization plan, per shape group (empty before the first step)."""
        plan = self._plans.plan
        return plan.report() if plan is not None else []

    def format_plan_report(self) -> str:
        """``plan_report`` as a text table, for logging once at start-up."""
        from muon_plugin.distributed.report import format_report

        return format_report(self.plan_report())


class MuonForeach(Muon):
    """``Muon`` with batched elementwise math and stacked same-shape orthogonalization."""

    batched = True
