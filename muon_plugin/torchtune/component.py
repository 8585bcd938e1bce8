"""The torchtune optimizer component: ``_component_: muon_plugin.torchtune.muon``.

``muon(named_params, **section)`` builds ONE optimizer (Muon and AdamW groups) from the
parameter classes of :mod:`muon_plugin.param_groups.rules`, exactly as the torchtitan plugins do:
matrices and expert stacks on Muon; embeddings, the output head, routers, norms, biases and other
vectors on AdamW, each class with its own lr, weight decay and algorithm and the user's extra
patterns. The classes are told apart by parameter names, so the component needs ``(name,
parameter)`` pairs: torchtune's own recipes pass ``model.parameters()`` and are refused with an
error naming the recipe that passes names (:mod:`muon_plugin.torchtune.full_finetune`).

Rank 0 logs the same build summary and rule table as the torchtitan plugins and, after the first
step, the distributed orthogonalization plan (``log_plan``). FSDP2 / TP parameters (DTensors)
need nothing else: the optimizer plans their orthogonalization itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer
from torchtune import utils

from muon_plugin.adapter.job import JobOptimizers, build_job_optimizers
from muon_plugin.adapter.resume import keep_job_settings_on_load
from muon_plugin.param_groups.rules import strip_fqn
from muon_plugin.torchtune.options import (
    OPTION_PREFIX,
    SECTION,
    OptimizerSection,
    TorchtuneConfigError,
    config_error,
    parse_optimizer_section,
)

__all__ = ["build_muon", "job_of", "muon", "named_parameters"]

log = utils.get_logger()

RECIPE = "muon_plugin/torchtune/full_finetune.py"

_JOB_ATTRIBUTE = "_muon_job"


def named_parameters(params: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """``params`` as ``(name, tensor)`` pairs, names without wrapper components.

    Raises :class:`TorchtuneConfigError` when an entry has no name (a plain tensor or a param
    group dict), the case of torchtune's stock recipes, which pass ``model.parameters()``.
    """
    named: list[tuple[str, torch.Tensor]] = []
    for item in params:
        if (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            named.append((strip_fqn(item[0]), item[1]))
            continue
        what = "a parameter without a name" if isinstance(item, torch.Tensor) else repr(item)[:80]
        raise TorchtuneConfigError(
            f"{SECTION}._component_: muon_plugin.torchtune.muon needs (name, parameter) pairs to "
            f"tell matrices from embeddings, norms and the output head, got {what}: torchtune's "
            f"stock recipes pass model.parameters(); run the recipe {RECIPE} (tune run {RECIPE} "
            "--config ...), which passes model.named_parameters()"
        )
    if not named:
        raise TorchtuneConfigError(f"{SECTION}: muon_plugin.torchtune.muon got no parameters")
    return named


def build_muon(named: list[tuple[str, torch.Tensor]], section: OptimizerSection) -> JobOptimizers:
    """The optimizer for ``named`` by the class rules and options of ``section``, built by the
    adapter core; a resume keeps the section's settings, lr included (see :func:`muon`).

    Errors (a pattern that matches nothing, a 1-D class set to Muon, a value the optimizer
    refuses) raise :class:`TorchtuneConfigError` naming ``optimizer.<key>``.
    """
    try:
        job = build_job_optimizers([named], section.muon, section.base, OPTION_PREFIX)
    except (TypeError, ValueError) as e:  # spelled by key as this section spells it
        raise config_error(e) from None
    keep_job_settings_on_load(job, lr_from="job", log=log)
    setattr(job.optimizers[0], _JOB_ATTRIBUTE, job)
    return job


def job_of(optimizer: Optimizer) -> JobOptimizers | None:
    """The :class:`JobOptimizers` an optimizer of :func:`muon` belongs to (None for others)."""
    return getattr(optimizer, _JOB_ATTRIBUTE, None)


def muon(params: Iterable[Any], **section: Any) -> Optimizer:
    """Build the Muon optimizer from ``(name, parameter)`` pairs and the ``optimizer:`` section.

    ``section``: the YAML keys (see :mod:`muon_plugin.torchtune.options`). Logs the build
    summary with the rule table on rank 0 and, after the first step, the orthogonalization plan
    (both off with ``log_plan: false``). Loading a checkpoint keeps this section's settings:
    every group setting and the lr (torchtune rebuilds its LR scheduler from the groups after
    the load), and rank 0 logs what changed.
    """
    job = build_muon(named_parameters(params), parse_optimizer_section(section))
    optimizer = job.optimizers[0]
    job.log_build(optimizer.register_step_post_hook, log)
    return optimizer
