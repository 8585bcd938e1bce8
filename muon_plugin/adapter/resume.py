"""On a resume, the job's settings win over the checkpoint's, and what changed is logged.

``torch.optim``'s ``load_state_dict`` restores every saved group setting, which would silently
override a changed ``ns_steps``, ``weight_decay``, ``momentum``, ... of the resumed job (and a
setting the checkpoint does not have, saved by an older version, would be dropped).
:func:`keep_job_settings_on_load` registers a load-state-dict pre-hook on each optimizer of a
job: every group setting the plugin builds groups from comes from the job, matched group by
group; the learning rate follows the framework's rule:

- ``"checkpoint"`` (torchtitan): ``lr`` and ``initial_lr`` come from the checkpoint, because the
  LR scheduler, checkpointed on its own, resumes from its saved base learning rates (as it does
  for AdamW); a different job lr is logged with the framework's way to apply it;
- ``"job"`` (TorchTune): the LR scheduler is rebuilt from the groups' ``initial_lr`` after the
  load, so the job's lr is written there and applies.

Rank 0 logs one line of what changed, then the rule table as loaded. The hooks run wherever
the framework loads (``OptimizersContainer.load_state_dict`` of either torchtitan release, a
full or DCP optimizer state dict in TorchTune), since each ends in ``Optimizer.load_state_dict``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch.optim import Optimizer

from muon_plugin.adapter.job import JobOptimizers, is_rank0
from muon_plugin.group_settings import plain

__all__ = [
    "LR_SOURCES",
    "SCHEDULED_KEYS",
    "keep_job_settings_on_load",
    "merge_group",
    "same_setting",
]

LrSource = Literal["checkpoint", "job"]
LR_SOURCES: tuple[LrSource, ...] = ("checkpoint", "job")

SCHEDULED_KEYS = ("lr", "initial_lr")
"""Group keys the LR scheduler owns."""

_NOT_SETTINGS = ("params", "param_names")


def same_setting(a: Any, b: Any) -> bool:
    """Whether two group values are the same setting (a one-element Tensor as its number, a
    list as a tuple, a bool never as a number)."""
    a, b = plain(a), plain(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_setting(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors of several elements
        return a is b


def _show(value: Any) -> str:
    return repr(plain(value))


def _show_lr(value: Any) -> str:
    return f"{float(plain(value)):.3g}"


def _base_lr(group: Mapping[str, Any]) -> Any:
    return group.get("initial_lr", group.get("lr"))


def merge_group(
    saved: Mapping[str, Any], live: Mapping[str, Any], lr_from: LrSource
) -> tuple[dict[str, Any], list[tuple[str, str, str]], tuple[str, str] | None]:
    """The group to load: ``saved`` with the job's settings (``live``), the settings that
    changed as ``(key, checkpoint value, job value)``, and with ``lr_from="checkpoint"`` the
    differing base lr as ``(job, checkpoint)`` (else None)."""
    group = dict(saved)
    changes: list[tuple[str, str, str]] = []
    for key, value in live.items():
        if key in _NOT_SETTINGS or key in SCHEDULED_KEYS:
            continue
        if key not in saved:
            changes.append((key, "none", _show(value)))
        elif not same_setting(saved[key], value):
            changes.append((key, _show(saved[key]), _show(value)))
        group[key] = value
    job_lr, saved_lr = _base_lr(live), _base_lr(saved)
    lr_differs = saved_lr is not None and float(plain(saved_lr)) != float(plain(job_lr))
    if lr_from == "checkpoint":
        return group, changes, (_show_lr(job_lr), _show_lr(saved_lr)) if lr_differs else None
    if lr_differs:
        changes.append(("lr", _show_lr(saved_lr), _show_lr(job_lr)))
    group["lr"] = live["lr"]
    if "initial_lr" in saved or "initial_lr" in live:
        group["initial_lr"] = job_lr
    return group, changes, None


class _JobSettingsWin:
    """The pre- and post-hook of one model part's optimizer."""

    def __init__(
        self, job: JobOptimizers, part: int, lr_from: LrSource, lr_hint: str,
        log: logging.Logger,
    ) -> None:  # fmt: skip
        self.job, self.part, self.lr_from = job, part, lr_from
        self.lr_hint, self.log = lr_hint, log
        self.prefix = f"model part {part}: " if len(job.optimizers) > 1 else ""
        self.pending: list[str] = []

    def before(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        saved_groups: Sequence[Mapping[str, Any]] = state_dict.get("param_groups", [])
        if len(saved_groups) != len(optimizer.param_groups):
            return None  # torch.optim reports the mismatch
        changed: dict[tuple[str, str, str], list[str]] = {}
        lr_changed: dict[tuple[str, str], list[str]] = {}
        groups = []
        for saved, live, cls in zip(
            saved_groups, optimizer.param_groups, self.job.group_classes[self.part], strict=True
        ):
            group, changes, lr_note = merge_group(saved, live, self.lr_from)
            groups.append(group)
            for change in changes:
                changed.setdefault(change, []).append(cls)
            if lr_note is not None:
                lr_changed.setdefault(lr_note, []).append(cls)
        changes = [
            f"{key}: {old} (checkpoint) -> {new} (job) in {', '.join(where)}"
            for (key, old, new), where in changed.items()
        ]
        self.job.set_changes_on_load(self.part, [self.prefix + c for c in changes])
        self.pending = []
        if changes:
            self.pending.append(
                f"Muon: {self.prefix}the job's settings replace the checkpoint's: "
                + "; ".join(changes)
            )
        if lr_changed:
            notes = "; ".join(
                f"job {job}, checkpoint {saved} in {', '.join(where)}"
                for (job, saved), where in lr_changed.items()
            )
            self.pending.append(
                f"Muon: {self.prefix}base lr differs from the checkpoint's ({notes}): "
                + self.lr_hint
            )
        return {**state_dict, "param_groups": groups}

    def after(self, optimizer: Optimizer) -> None:
        lines, self.pending = self.pending, []
        if lines and is_rank0():
            self.log.warning("\n".join(lines))
            self.log.info(
                f"Muon param groups after loading the checkpoint:\n{self.job.format_rules()}"
            )


def keep_job_settings_on_load(
    job: JobOptimizers,
    *,
    lr_from: LrSource,
    log: logging.Logger,
    lr_hint: str = "",
) -> None:
    """Make every later ``load_state_dict`` of ``job``'s optimizers keep the job's settings.

    ``lr_from``: where ``lr`` / ``initial_lr`` come from (see the module docstring);
    ``lr_hint``: with ``"checkpoint"``, what the log says about a job lr that differs from the
    checkpoint's (how the framework applies a new one).
    """
    if lr_from not in LR_SOURCES:
        raise ValueError(f"lr_from: invalid value {lr_from!r}; expected one of {LR_SOURCES}")
    for part, optimizer in enumerate(job.optimizers):
        hooks = _JobSettingsWin(job, part, lr_from, lr_hint, log)
        optimizer.register_load_state_dict_pre_hook(hooks.before)
        optimizer.register_load_state_dict_post_hook(hooks.after)
