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

from muon_plugin.distributed.plan import (
    OrthogonalizationPlan,
    check_grad_layouts,
    plan_orthogonalization,
)
from muon_plugin.functional import decay_and_update_, momentum_update_
from muon_plugin.orthogonalize import (
    LR_ADJUSTMENTS,
    MatrixSpec,
    validate_steps,
)

ALGORITHMS = ("muon", "adamw", "adam")

DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "wd": 0.1,
    "use_cautious_wd": True,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "orthogonalization_strategy": "polar_express",
    "adam_betas": (0.9, 0.95),
    "adam_eps": 1e-8,
    "is_adamw": True,
    "fused_adam": True,
    "compile": False,
    "lr_adjust": "keller",
    "flatten": False,
    "split_sizes": None,
    "algorithm": "muon",
}

# Keys torch.optim or LR schedulers put into groups themselves.
FOREIGN_GROUP_KEYS = {"params", "param_names", "initial_lr"}
# Group settings of the elementwise math, besides the spec, that every rank of a mesh must share
# (checked when a plan is built; ``lr`` is left out: schedulers change it every step).
AGREED_GROUP_KEYS = ("momentum", "nesterov", "wd", "use_cautious_wd")
KEY_HINTS = {"weight_decay": "wd", "betas": "adam_betas", "eps": "adam_eps"}


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(Optimizer):
    """Muon for matrix params, Adam/AdamW for the rest; see the module docstring.

    Args:
        params: parameters or param groups (``named_parameters()`` works and improves errors).
        lr: learning rate. Muon groups scale it per matrix by ``lr_adjust``.
        wd: decoupled weight decay, applied with the group ``lr``.
        use_cautious_wd: decay only where the update and the parameter agree in sign.
        momentum, nesterov: Muon's momentum (fp32 buffers for bf16/fp16 parameters).
        ns_steps, orthogonalization_strategy: iteration count and ``"polar_express"`` or
            ``"newton_schulz"``.
        adam_betas, adam_eps, is_adamw, fused_adam: the Adam path (``is_adamw=False`` couples
            weight decay into the gradient).
        compile: ``torch.compile`` the orthogonalization.
        lr_adjust: Muon's shape rule: ``"keller"`` ``sqrt(max(1, rows/cols))``,
            ``"match_rms_adamw"`` ``0.2*sqrt(max(rows, cols))``, ``"spectral"``
            ``sqrt(rows/cols)``, ``"none"``.
        flatten: treat >2-D params as ``(dim0, -1)`` matrices instead of batches of matrices.
        split_sizes: row blocks of fused weights (e.g. QKV) orthogonalized independently.
        replicate_group: process group (or 1-D mesh) that plain-tensor parameters are
            replicated over (DDP); their orthogonalization is then split over its ranks instead
            of repeated on each. DTensor parameters (FSDP2, TP, HSDP) need nothing.
    """

    batched = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        wd: float = 0.1,
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
        lr_adjust: str = "keller",
        flatten: bool = False,
        split_sizes: tuple[int, ...] | None = None,
        replicate_group: Any = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            wd=wd,
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
            lr_adjust=lr_adjust,
            flatten=flatten,
            split_sizes=split_sizes,
            algorithm="muon",
        )
        self._plan: OrthogonalizationPlan | None = None
        self._plan_key: tuple | None = None
        # Process group (or 1-D mesh) plain-tensor params are replicated over (DDP): their
        # orthogonalization is then split over its ranks. DTensor params need nothing.
        self.replicate_group = replicate_group
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its keys, values and parameters (errors name them)."""
        index = len(self.param_groups)
        unknown = set(param_group) - set(DEFAULTS) - FOREIGN_GROUP_KEYS
        if unknown:
            key = sorted(unknown)[0]
            hint = f" (did you mean {KEY_HINTS[key]!r}?)" if key in KEY_HINTS else ""
            raise ValueError(
                f"param group {index}: unknown key {key!r}{hint}; "
                f"known keys: {sorted(set(DEFAULTS) | {'params'})}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["split_sizes"] is not None:
            group["split_sizes"] = tuple(group["split_sizes"])
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
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
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
            lr=group["lr"],
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
        for group in groups:
            ps = [p for p in group["params"] if p.grad is not None]
            counts.append(len(ps))
            if not ps:
                continue
            check_grad_layouts(group, ps)
            directions += self._momentum_directions(group, ps)
            params += ps
            specs += [group_spec(group)] * len(ps)
        if not params:
            return
        # 2. Orthogonalize every Muon parameter of the step through one plan.
        updates = self._orthogonalization_plan(params, specs).run(directions)
        # 3. Weight decay and update, group by group.
        start = 0
        for group, n in zip(groups, counts, strict=True):
            ps = [local(p) for p in params[start : start + n]]
            us = updates[start : start + n]
            for chunk in self._chunks(n):
                decay_and_update_(
                    [ps[i] for i in chunk],
                    [us[i] for i in chunk],
                    group["lr"],
                    group["wd"],
                    group["use_cautious_wd"],
                )
            start += n

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
        """Load like ``torch.optim``, but keep the momentum in its own dtype and format.

        ``torch.optim`` casts every floating state tensor to its parameter's dtype, which would
        turn the fp32 momentum of bf16 parameters into bf16 (and MuonLP's codes into floats).
        Momentum entries are held out of that cast and restored by ``_restore_momentum``.
        """
        saved_groups = state_dict["param_groups"]
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=False,
            )
        )
        state: dict[Any, Any] = {}
        held: dict[Tensor, dict[str, Tensor]] = {}
        for key, entry in state_dict["state"].items():
            p = id_map.get(key)
            if p is not None and isinstance(entry, dict):
                momentum = {k: v for k, v in entry.items() if k in self.momentum_state_keys}
                if momentum:
                    held[p] = momentum
                    entry = {k: v for k, v in entry.items() if k not in momentum}
            state[key] = entry
        super().load_state_dict({**state_dict, "state": state})
        with torch.no_grad():
            for p, saved in held.items():
                self.state[p].update(self._restore_momentum(p, saved))
        # torch.optim keeps Adam's step where it was saved unless a group says "fused"; ours
        # says "fused_adam", and the fused kernel wants it on the parameter's device.
        for group in self.param_groups:
            if group["algorithm"] != "muon" and group["fused_adam"]:
                for p in group["params"]:
                    if "step" in self.state.get(p, {}):
                        self.state[p]["step"] = self.state[p]["step"].to(torch.float32).to(p.device)

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
    return _spec(
        group["ns_steps"],
        group["orthogonalization_strategy"],
        group["lr_adjust"],
        group["flatten"],
        None if split is None else tuple(split),
        group["compile"],
    )


@functools.lru_cache(maxsize=256)
def _spec(
    steps: int,
    strategy: str,
    lr_adjust: str,
    flatten: bool,
    split_sizes: tuple[int, ...] | None,
    compile: bool,
) -> MatrixSpec:
    """One spec object per setting: the step's plan key then compares specs by identity."""
    return MatrixSpec(steps, strategy, lr_adjust, flatten, split_sizes, compile)


def describe(group: dict[str, Any], i: int, p: Tensor) -> str:
    """A parameter's name for error messages: its FQN when given, else its position."""
    names = group.get("param_names")
    name = repr(names[i]) if names else f"#{i}"
    return f"parameter {name} (shape {tuple(p.shape)}, dtype {p.dtype})"


def validate_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the key, value or parameter that makes ``group`` unusable."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    for key in ("lr", "wd", "adam_eps"):
        value = group[key]
        if isinstance(value, Tensor):
            value = value.item()
        if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise ValueError(f"{key} must be a number >= 0, got {group[key]!r}")
    betas = group["adam_betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"adam_betas must be two numbers in [0, 1), got {betas!r}")
    if algorithm != "muon":
        return
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']!r}")
    validate_steps(group["ns_steps"], group["orthogonalization_strategy"])
    if group["lr_adjust"] not in LR_ADJUSTMENTS:
        raise ValueError(
            f"unknown lr_adjust {group['lr_adjust']!r}; expected one of {LR_ADJUSTMENTS}"
        )
    split = group["split_sizes"]
    if split is not None and (not split or not all(isinstance(s, int) and s > 0 for s in split)):
        raise ValueError(f"split_sizes must be positive integers, got {split!r}")
    for i, p in enumerate(group["params"]):
        if p.is_complex():
            raise ValueError(f"Muon cannot update complex {describe(group, i, p)}")
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
