"""``Muon`` and ``MuonForeach``: Muon on matrices and Adam/AdamW on the rest, in one optimizer.

Each param group picks its algorithm with the ``"algorithm"`` key (``"muon"`` default,
``"adamw"``, ``"adam"``). A step:

1. Adam groups run ``torch.optim``'s own functional Adam (fused where asked).
2. Muon groups update momentum on the local shards (:mod:`muon_plugin.functional`), hand the
   directions of every Muon parameter to one cached :class:`~muon_plugin.distributed.plan.
   OrthogonalizationPlan`, which assembles whole matrices, orthogonalizes them and returns the
   local shards, then apply weight decay and the update per group.

``Muon`` runs the elementwise math and the orthogonalization matrix by matrix; ``MuonForeach``
runs the same math on whole groups with ``torch._foreach_*`` and stacks same-shape matrices
into one batched orthogonalization. Parameters may be plain tensors or DTensors (FSDP2, TP).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.adam import adam as adam_functional

from muon_plugin.defaults import ALGORITHMS, DEFAULTS, LR_ADJUSTMENTS
from muon_plugin.distributed.plan import (
    OrthogonalizationPlan,
    check_grad_layouts,
    plan_orthogonalization,
)
from muon_plugin.functional import decay_and_update_, momentum_update_
from muon_plugin.orthogonalize import (
    MatrixSpec,
    validate_coefficients,
    validate_steps,
)

# Keys torch.optim or LR schedulers put into groups themselves.
TORCH_GROUP_KEYS = {"params", "param_names", "initial_lr"}
# Group settings of the elementwise math, besides the spec, that every rank of a mesh must share
# (checked when a plan is built; ``lr`` is left out: schedulers change it every step).
AGREED_GROUP_KEYS = ("momentum", "nesterov", "wd", "use_cautious_wd")

# torch.optim's names for our settings (torch.optim.Muon's, and Adam's ``betas``), accepted in
# the constructor and in param groups and stored under our names. ``eps`` is torch.optim.Muon's
# Newton-Schulz epsilon in Muon groups and Adam's epsilon in Adam/AdamW groups.
SYNONYMS: dict[str, str] = {
    "weight_decay": "wd",
    "adjust_lr_fn": "lr_adjust",
    "eps": "ns_eps",
    "betas": "adam_betas",
}
# torch.optim.Muon's ``adjust_lr_fn`` values (None is its default, "original").
TORCH_LR_ADJUST = {None: "keller", "original": "keller", "match_rms_adamw": "match_rms_adamw"}


def synonym_of(name: str, algorithm: str) -> str:
    """Our key for torch.optim's setting ``name`` in a group of ``algorithm``."""
    if name == "eps" and algorithm != "muon":
        return "adam_eps"
    return SYNONYMS[name]


def resolve_synonyms(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """``settings`` with torch.optim's names replaced by ours (values translated).

    Raises ValueError naming both keys when a setting is given under both names.
    """
    algorithm = settings.get("algorithm", DEFAULTS["algorithm"])
    out = dict(settings)
    for name in SYNONYMS:
        if name not in out:
            continue
        ours = synonym_of(name, algorithm)
        if ours in out:
            raise ValueError(
                f"{where}: both {name!r} and {ours!r} are given, but they are one setting "
                f"({name!r} is torch.optim's name for {ours!r}); give only one"
            )
        value = out.pop(name)
        if name == "adjust_lr_fn":
            value = torch_lr_adjust(value)
        out[ours] = value
    return out


def torch_lr_adjust(value: Any) -> str:
    """Our ``lr_adjust`` for torch.optim.Muon's ``adjust_lr_fn`` value (ours are accepted too)."""
    if value in TORCH_LR_ADJUST:
        return TORCH_LR_ADJUST[value]
    if value in LR_ADJUSTMENTS:
        return value
    raise ValueError(
        f"Adjust learning rate function {value} is not supported: adjust_lr_fn must be one of "
        f"{sorted(k for k in TORCH_LR_ADJUST if k)} or None (or lr_adjust one of "
        f"{LR_ADJUSTMENTS})"
    )


def scalar(value: Any) -> Any:
    """A one-element Tensor hyperparameter as a 0-dim Tensor (as torch.optim does), else as is."""
    return value.squeeze() if isinstance(value, Tensor) and value.dim() != 0 else value


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(Optimizer):
    """Muon for matrix params, Adam/AdamW for the rest; see the module docstring.

    Args:
        params: parameters or param groups (``named_parameters()`` works and improves errors).
        lr: learning rate (a float or a one-element Tensor). Muon groups scale it per matrix
            by ``lr_adjust``.
        wd: decoupled weight decay, applied with the group ``lr`` (default 0.1).
        use_cautious_wd: decay only where the update and the parameter agree in sign.
        momentum, nesterov: Muon's momentum (fp32 buffers for bf16/fp16 parameters).
        ns_steps, orthogonalization_strategy: iteration count and ``"polar_express"`` or
            ``"newton_schulz"``.
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

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        wd: float | None = None,
        use_cautious_wd: bool = True,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        orthogonalization_strategy: str = "polar_express",
        adam_betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        is_adamw: bool = True,
        fused_adam: bool = True,
        compile: bool = False,
        lr_adjust: str | None = None,
        flatten: bool = False,
        split_sizes: tuple[int, ...] | None = None,
        replicate_group: Any = None,
        *,
        ns_coefficients: tuple[float, float, float] | None = None,
        ns_eps: float | None = None,
        skip_nonfinite: bool = False,
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
            lr=lr,
            wd=named.get("wd", DEFAULTS["wd"]),
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
            lr_adjust=named.get("lr_adjust", DEFAULTS["lr_adjust"]),
            flatten=flatten,
            split_sizes=split_sizes,
            ns_coefficients=ns_coefficients,
            ns_eps=named.get("ns_eps", DEFAULTS["ns_eps"]),
            algorithm="muon",
        )
        self._plan: OrthogonalizationPlan | None = None
        self._plan_key: tuple | None = None
        # Process group (or 1-D mesh) plain-tensor params are replicated over (DDP): their
        # orthogonalization is then split over its ranks. DTensor params need nothing.
        self.replicate_group = replicate_group
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_updates = 0
        for key in NUMBER_KEYS:  # before the params are read, as torch.optim does
            validate_number(key, defaults[key])
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ copies

    # Instance attributes that are configuration (kept by pickling and deepcopy), beyond
    # torch.optim's defaults, state and param groups. Subclasses extend this.
    config_attributes: tuple[str, ...] = ("replicate_group", "skip_nonfinite", "skipped_updates")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self.config_attributes:
            state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plan = None
        self._plan_key = None
        self._rebuild_caches()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling drops the process group (not picklable); see the class docstring.
        reduced = super().__reduce_ex__(protocol)
        if self.replicate_group is None or not isinstance(reduced, tuple) or len(reduced) < 3:
            return reduced
        state = dict(reduced[2])
        state["replicate_group"] = None
        return (*reduced[:2], state, *reduced[3:])

    def __deepcopy__(self, memo: dict[int, Any]) -> Muon:
        # The copy shares the process group (groups cannot be copied); the rest is copied.
        if self.replicate_group is not None:
            memo[id(self.replicate_group)] = self.replicate_group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def _rebuild_caches(self) -> None:
        """Rebuild what derives from the param groups after unpickling (subclasses extend)."""

    # ------------------------------------------------------------------ validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its keys, values and parameters (errors name them)."""
        index = len(self.param_groups)
        param_group = resolve_synonyms(param_group, f"param group {index}")
        unknown = set(param_group) - set(DEFAULTS) - TORCH_GROUP_KEYS
        if unknown:
            key = sorted(unknown)[0]
            raise ValueError(
                f"param group {index}: unknown key {key!r}; known keys: "
                f"{sorted(set(DEFAULTS) | {'params'})} and torch.optim's names "
                f"{sorted(SYNONYMS)}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key in ("split_sizes", "ns_coefficients"):
            if group[key] is not None:
                group[key] = tuple(group[key])
        group["adam_betas"] = tuple(group["adam_betas"])
        try:
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
                self._adam_step(group)
        if muon_groups:
            self._muon_step(muon_groups)
        return loss

    def _adam_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        fused = group["fused_adam"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if fused
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
            if torch.is_complex(p):
                # As torch.optim.Adam/AdamW: complex tensors are updated as real (..., 2) views.
                tensors = tuple(torch.view_as_real(t) for t in tensors)
            for out, t in zip((params, grads, exp_avgs, exp_avg_sqs), tensors, strict=True):
                out.append(t)
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["adam_betas"]
        adam_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None if fused else self.batched,
            fused=fused or None,
            # "adam" is always coupled (L2) decay; "adamw" is decoupled unless is_adamw=False.
            decoupled_weight_decay=group["algorithm"] == "adamw" and group["is_adamw"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=scalar(group["lr"]),
            weight_decay=group["wd"],
            eps=group["adam_eps"],
            maximize=False,
        )

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        # 1. Momentum, on local shards, group by group.
        params: list[Tensor] = []
        specs: list[MatrixSpec] = []
        directions: list[Tensor] = []
        counts: list[int] = []  # Muon params with a grad, per group
        saved: list[dict[str, Tensor]] = []  # momentum before this step (skip_nonfinite only)
        for group in groups:
            ps = [p for p in group["params"] if p.grad is not None]
            counts.append(len(ps))
            if not ps:
                continue
            check_grad_layouts(group, ps)
            if self.skip_nonfinite:
                saved += [self._momentum_snapshot(p) for p in ps]
            directions += self._momentum_directions(group, ps)
            params += ps
            specs += [group_spec(group)] * len(ps)
        if not params:
            return
        # 2. Orthogonalize every Muon parameter of the step through one plan.
        updates = self._orthogonalization_plan(params, specs).run(directions)
        skipped: dict[int, tuple[Tensor, Tensor]] = {}  # k -> (finite mask, weights before)
        if self.skip_nonfinite:
            skipped = self._skip_nonfinite(params, updates, saved)
        # 3. Weight decay and update, group by group.
        start = 0
        for group, n in zip(groups, counts, strict=True):
            ps = [local(p) for p in params[start : start + n]]
            us = updates[start : start + n]
            for chunk in self._chunks(n):
                decay_and_update_(
                    [ps[i] for i in chunk],
                    [us[i] for i in chunk],
                    scalar(group["lr"]),
                    group["wd"],
                    group["use_cautious_wd"],
                )
            start += n
        for k, (finite, before) in skipped.items():
            p = local(params[k])
            p.copy_(torch.where(finite, p, before))

    # ------------------------------------------------------------------ non-finite updates

    def _momentum_snapshot(self, p: Tensor) -> dict[str, Tensor]:
        """Copies of the local momentum state of ``p`` (created first if missing)."""
        self._init_momentum(p)
        return {
            k: local(v).clone()
            for k, v in self.state[p].items()
            if k in self.momentum_state_keys and isinstance(v, Tensor)
        }

    def _init_momentum(self, p: Tensor) -> None:
        """Create the (zero) momentum state of ``p`` if missing (``MuonLP`` overrides)."""
        self._momentum_buffer(p)

    def _skip_nonfinite(
        self, params: list[Tensor], updates: list[Tensor], saved: list[dict[str, Tensor]]
    ) -> dict[int, tuple[Tensor, Tensor]]:
        """Restore the momentum where an update is non-finite; the weights to restore after it.

        Newton-Schulz turns any NaN/Inf in a matrix (or row block) into an all-non-finite
        result, and every rank receives its shard of that result, so the elementwise mask
        ``isfinite(update)`` selects whole matrices, the same ones on every rank. One
        device-to-host copy per step (the per-parameter flags).
        """
        norms = torch._foreach_norm(list(updates))
        finite = torch.stack([n.float() for n in norms]).isfinite().tolist()
        bad = [k for k, ok in enumerate(finite) if not ok]
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for k in bad:
            p = params[k]
            finite = torch.isfinite(updates[k])
            state = self.state[p]
            for key, before in saved[k].items():
                now = local(state[key])
                if key == "momentum_buffer" and now.shape == finite.shape:
                    now.copy_(torch.where(finite, now, before))
                else:  # quantized formats: the whole local state of the parameter
                    now.copy_(before)
            out[k] = (finite, local(p).clone())
        self.skipped_updates += len(bad)
        return out

    def _chunks(self, n: int) -> list[range]:
        """Index ranges the elementwise math runs on: all at once, or one by one."""
        return [range(n)] if self.batched else [range(i, i + 1) for i in range(n)]

    def _momentum_directions(self, group: dict[str, Any], ps: list[Tensor]) -> list[Tensor]:
        """Update the momentum of ``ps`` (params with grads) and return their local directions.

        Subclasses that store momentum differently (``MuonLP``) override this.
        """
        bufs = [local(self._momentum_buffer(p)) for p in ps]
        grads = [local(p.grad) for p in ps]
        directions: list[Tensor] = []
        for chunk in self._chunks(len(ps)):
            directions += momentum_update_(
                [grads[i] for i in chunk],
                [bufs[i] for i in chunk],
                group["momentum"],
                group["nesterov"],
            )
        return directions

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            dtype = momentum_dtype(p.dtype)
            buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["momentum_buffer"] = buf
        return buf

    def _orthogonalization_plan(
        self, params: list[Tensor], specs: list[MatrixSpec]
    ) -> OrthogonalizationPlan:
        """The cached plan for this set of parameters, layouts and specs (rebuilt on change)."""
        key = tuple(
            (id(p), p.shape, p.placements if isinstance(p, DTensor) else None, spec)
            for p, spec in zip(params, specs, strict=True)
        )
        if key != self._plan_key:
            # Names (else group positions) and settings, which the ranks of a mesh must agree on.
            names, settings = {}, {}
            for gi, g in enumerate(self.param_groups):
                given = g.get("param_names")
                for j, p in enumerate(g["params"]):
                    names[id(p)] = given[j] if given else f"group {gi} #{j}"
                    settings[id(p)] = {k: _plain(g[k]) for k in AGREED_GROUP_KEYS}
            self._plan = plan_orthogonalization(
                params,
                specs,
                batched=self.batched,
                names=[names[id(p)] for p in params],
                replicate_group=self.replicate_group,
                settings=[settings[id(p)] for p in params],
            )
            self._plan_key = key
        assert self._plan is not None
        return self._plan

    # ------------------------------------------------------------------ checkpoints

    # State keys that hold Muon momentum (MuonLP stores codes and scales instead).
    momentum_state_keys: tuple[str, ...] = ("momentum_buffer",)

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
          ``_restore_momentum``.
        """
        state_dict = self._match_by_name(state_dict)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
                f"{len(self.param_groups)}"
            )
        for i, (saved_group, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved_group["params"]) != len(group["params"]):
                raise ValueError(
                    f"loaded state dict: parameter group {i} has {len(saved_group['params'])} "
                    f"parameters, the optimizer's {len(group['params'])}"
                )
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )
        where = {id(p): (g, i) for g in self.param_groups for i, p in enumerate(g["params"])}
        state: dict[Any, Any] = {}
        held: dict[Tensor, dict[str, Tensor]] = {}
        for key, entry in state_dict["state"].items():
            p = id_map.get(key)
            if p is not None and isinstance(entry, dict):
                check_state_entry(p, entry, *where[id(p)], self.momentum_state_keys)
                momentum = {k: v for k, v in entry.items() if k in self.momentum_state_keys}
                if momentum:
                    held[p] = momentum
                    entry = {k: v for k, v in entry.items() if k not in momentum}
            state[key] = entry
        super().load_state_dict({**state_dict, "state": state})
        for group in self.param_groups:  # groups saved before a setting existed get its default
            for key in DEFAULTS:
                if key in self.defaults:
                    group.setdefault(key, self.defaults[key])
        with torch.no_grad():
            for p, saved in held.items():
                group, i = where[id(p)]
                try:
                    restored = self._restore_momentum(p, saved)
                except ValueError as e:
                    what = describe(group, i, p)
                    raise ValueError(f"cannot load the state of {what}: {e}") from e
                self.state[p].update(restored)
        # torch.optim keeps Adam's step where it was saved unless a group says "fused"; ours
        # says "fused_adam", and the fused kernel wants it on the parameter's device.
        for group in self.param_groups:
            if group["algorithm"] != "muon" and group["fused_adam"]:
                for p in group["params"]:
                    if "step" in self.state.get(p, {}):
                        self.state[p]["step"] = self.state[p]["step"].to(torch.float32).to(p.device)
        self._plan = None
        self._plan_key = None

    def _match_by_name(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each saved group's ``params`` in the live order, matched by name.

        Returned unchanged unless every saved and every live group carries ``param_names``.
        """
        saved_groups = state_dict["param_groups"]
        if not saved_groups or not all(
            "param_names" in g for g in chain(saved_groups, self.param_groups)
        ):
            return state_dict
        saved_ids: dict[str, Any] = {}
        for gi, g in enumerate(saved_groups):
            names = g["param_names"]
            if len(names) != len(g["params"]):
                raise ValueError(
                    f"loaded state dict: parameter group {gi} has {len(g['params'])} "
                    f"parameters but {len(names)} param_names"
                )
            for name, pid in zip(names, g["params"], strict=True):
                if name in saved_ids:
                    raise ValueError(f"loaded state dict names parameter {name!r} twice")
                saved_ids[name] = pid
        live = [n for g in self.param_groups for n in g["param_names"]]
        if len(set(live)) != len(live):
            dup = next(n for n in live if live.count(n) > 1)
            raise ValueError(f"the optimizer names parameter {dup!r} twice")
        missing = [n for n in live if n not in saved_ids]
        if missing:
            raise ValueError(
                f"loaded state dict has no parameter {missing[0]!r} (of {len(missing)} missing); "
                "its state would silently start from zero"
            )
        extra = [n for n in saved_ids if n not in set(live)]
        if extra:
            raise ValueError(
                f"loaded state dict has parameter {extra[0]!r} (of {len(extra)}) that this "
                "optimizer does not have; its state would be silently dropped"
            )
        groups = []
        for saved_group, group in zip(saved_groups, self.param_groups, strict=False):
            names = list(group["param_names"])
            groups.append(
                {**saved_group, "params": [saved_ids[n] for n in names], "param_names": names}
            )
        groups += saved_groups[len(groups) :]
        return {**state_dict, "param_groups": groups}

    def _restore_momentum(self, p: Tensor, saved: dict[str, Tensor]) -> dict[str, Tensor]:
        """Loaded momentum entries of ``p`` in this optimizer's dtype, on ``p``'s device."""
        return {k: v.to(dtype=momentum_dtype(p.dtype), device=p.device) for k, v in saved.items()}

    # ------------------------------------------------------------------ reporting

    def plan_report(self) -> list[dict[str, Any]]:
        """The distributed orthogonalization plan, per shape group (empty before the first step)."""
        return self._plan.report() if self._plan is not None else []

    def format_plan_report(self) -> str:
        """``plan_report`` as a text table, for logging once at start-up."""
        from muon_plugin.distributed.report import format_report

        return format_report(self.plan_report())


class MuonForeach(Muon):
    """``Muon`` with batched elementwise math and stacked same-shape orthogonalization."""

    batched = True


# ---------------------------------------------------------------------- group rules


def _plain(value: Any) -> Any:
    """A group setting as a Python number when it is a one-element Tensor (device-free repr)."""
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


def momentum_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Muon momentum is fp32 for bf16/fp16 parameters, else the parameter's own dtype."""
    return torch.float32 if param_dtype in (torch.bfloat16, torch.float16) else param_dtype


def group_spec(group: dict[str, Any]) -> MatrixSpec:
    """The orthogonalization spec of a Muon group."""
    split = group["split_sizes"]
    coefficients = group["ns_coefficients"]
    return _spec(
        group["ns_steps"],
        group["orthogonalization_strategy"],
        group["lr_adjust"],
        group["flatten"],
        None if split is None else tuple(split),
        group["compile"],
        None if coefficients is None else tuple(float(c) for c in coefficients),
        float(group["ns_eps"]),
    )


@functools.lru_cache(maxsize=256)
def _spec(
    steps: int,
    strategy: str,
    lr_adjust: str,
    flatten: bool,
    split_sizes: tuple[int, ...] | None,
    compile: bool,
    coefficients: tuple[float, float, float] | None,
    eps: float,
) -> MatrixSpec:
    """One spec object per setting: the step's plan key then compares specs by identity."""
    return MatrixSpec(steps, strategy, lr_adjust, flatten, split_sizes, compile, coefficients, eps)


def describe(group: dict[str, Any], i: int, p: Tensor) -> str:
    """A parameter's name for error messages: its FQN when given, else its position."""
    names = group.get("param_names")
    name = repr(names[i]) if names else f"#{i}"
    return f"parameter {name} (shape {tuple(p.shape)}, dtype {p.dtype})"


def check_state_entry(
    p: Tensor, entry: dict[str, Any], group: dict[str, Any], i: int, momentum_keys: tuple[str, ...]
) -> None:
    """Raise ValueError naming ``p`` and the key when a saved state tensor cannot be its state.

    Parameter-shaped entries (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) must have the
    parameter's (global) shape and a floating dtype, complex for a complex parameter; other
    momentum formats are checked when they are converted.
    """
    for key, value in entry.items():
        if not isinstance(value, Tensor) or key not in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            continue
        if key == "momentum_buffer" and key not in momentum_keys:
            continue
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"cannot load the state of {describe(group, i, p)}: {key!r} has shape "
                f"{tuple(value.shape)}"
            )
        want_complex = p.is_complex()
        ok = value.is_complex() if want_complex else value.is_floating_point()
        if not ok:
            raise ValueError(
                f"cannot load the state of {describe(group, i, p)}: {key!r} has dtype {value.dtype}"
            )


NUMBER_KEYS = ("lr", "wd", "adam_eps", "ns_eps")
"""Settings that must be a number >= 0 (or a one-element Tensor holding one)."""


def validate_number(key: str, value: Any) -> None:
    """Raise ValueError naming ``key`` unless ``value`` is a number >= 0 or a one-element
    Tensor holding one."""
    number = value
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"Tensor {key} must be 1-element (a number or a one-element Tensor), got "
                f"a Tensor of shape {tuple(value.shape)}"
            )
        number = value.item()
    if not isinstance(number, (int, float)) or math.isnan(number) or number < 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")


def validate_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the key, value or parameter that makes ``group`` unusable."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    for key in NUMBER_KEYS:
        validate_number(key, group[key])
    betas = group["adam_betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"adam_betas must be two numbers in [0, 1), got {betas!r}")
    if algorithm != "muon":
        return
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']!r}")
    validate_steps(group["ns_steps"], group["orthogonalization_strategy"])
    validate_coefficients(group["ns_coefficients"])
    if group["lr_adjust"] not in LR_ADJUSTMENTS:
        raise ValueError(
            f"unknown lr_adjust {group['lr_adjust']!r}; expected one of {LR_ADJUSTMENTS}"
        )
    split = group["split_sizes"]
    if split is not None and (not split or not all(isinstance(s, int) and s > 0 for s in split)):
        raise ValueError(f"split_sizes must be positive integers, got {split!r}")
    for i, p in enumerate(group["params"]):
        if p.is_complex():
            raise ValueError(
                f"Muon does not support complex parameters: {describe(group, i, p)}; put it "
                "in a group with algorithm='adamw'"
            )
        if p.ndim < 2:
            raise ValueError(
                f"Muon needs matrices (>= 2-D) but got {describe(group, i, p)}; "
                "put it in a group with algorithm='adamw'"
            )
        if not p.is_floating_point():
            raise ValueError(f"Muon cannot update non-floating-point {describe(group, i, p)}")
        rows = MatrixSpec(flatten=group["flatten"]).matrix_view(tuple(p.shape))[1]
        if split is not None and sum(split) != rows:
            raise ValueError(
                f"split_sizes {split} sum to {sum(split)} but {describe(group, i, p)} "
                f"has {rows} rows"
            )
