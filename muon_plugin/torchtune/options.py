"""The ``optimizer:`` section of a torchtune YAML config, read into the shared option schema.

A torchtune ``_component_`` receives the section's keys as keyword arguments. The section takes
torch.optim's names for the settings every parameter class starts from (``lr``,
``weight_decay``, ``betas``, ``eps``, ``fused``: an AdamW section keeps working) and, flat beside
them, every ``[optimizer.muon]`` option of :class:`muon_plugin.param_groups.options.MuonConfig`
(``ns_steps``, ``norm_weight_decay``, ``embedding_lr``, ``matrix_patterns``, ...). Defaults come
from the optimizer core (:data:`muon_plugin.defaults.DEFAULTS`) and from ``MuonConfig``; nothing
is restated here. Errors name the YAML key, ``optimizer.<key>``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from muon_plugin.defaults import DEFAULTS
from muon_plugin.param_groups.builder import BaseHyperparams, KeySpelling, core_keys
from muon_plugin.param_groups.options import (
    MUON_CONFIG_KEYS,
    MuonConfig,
    validate_job_optimizer,
)

__all__ = [
    "BASE_KEYS",
    "OPTION_KEYS",
    "SECTION",
    "OptimizerSection",
    "TorchtuneConfigError",
    "parse_optimizer_section",
    "TORCHTUNE_KEYS",
    "config_error",
]

SECTION = "optimizer"
"""The YAML section the component is built from (``cfg.optimizer``)."""

BASE_KEYS: tuple[str, ...] = ("lr", "weight_decay", "betas", "eps", "fused")
"""torch.optim's names for the defaults of every parameter class."""

OPTION_KEYS: tuple[str, ...] = BASE_KEYS + MUON_CONFIG_KEYS
"""Every key the ``optimizer:`` section accepts besides ``_component_``."""

TORCHTUNE_KEYS = KeySpelling(
    options=SECTION,
    core=core_keys(SECTION, SECTION, f"{SECTION}.betas", f"{SECTION}.eps"),
    job={"beta1": f"{SECTION}.betas[0]", "beta2": f"{SECTION}.betas[1]"},
)
"""The section's spelling of every setting: the Muon options flat beside torch.optim's names."""

OPTION_PREFIX = f"{SECTION}."
"""How the section's option names are written (``optimizer.ns_steps``)."""


class TorchtuneConfigError(ValueError):
    """A setting of the torchtune config that Muon cannot run with; the message names the key."""


def config_error(error: Exception) -> TorchtuneConfigError:
    """``error`` (a :class:`~muon_plugin.errors.SettingError` of the schema or the optimizer)
    naming its setting as this section does."""
    return TorchtuneConfigError(str(TORCHTUNE_KEYS.spell(error)))


@dataclass(frozen=True)
class OptimizerSection:
    """The ``optimizer:`` section, read: the job-wide defaults and the Muon options."""

    base: BaseHyperparams
    muon: MuonConfig


def _betas(value: Any) -> tuple[Any, Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TorchtuneConfigError(
            f"{SECTION}.betas: invalid value {value!r}; expected two numbers, e.g. [0.9, 0.95]"
        )
    return value[0], value[1]


def _unknown(key: str) -> TorchtuneConfigError:
    close = difflib.get_close_matches(key, OPTION_KEYS, n=1)
    if close:
        return TorchtuneConfigError(
            f"{SECTION}.{key}: unknown option; did you mean {SECTION}.{close[0]}?"
        )
    return TorchtuneConfigError(
        f"{SECTION}.{key}: unknown option (valid: _component_, {', '.join(OPTION_KEYS)})"
    )


def parse_optimizer_section(options: Mapping[str, Any]) -> OptimizerSection:
    """Check the section's keys and values and split them into defaults and Muon options.

    ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``fused`` default to the optimizer core's
    ``lr``, ``wd``, ``adam_betas``, ``adam_eps`` and ``fused_adam``; the Muon options to
    ``MuonConfig``'s defaults. Raises :class:`TorchtuneConfigError` naming ``optimizer.<key>``.
    """
    for key in options:
        if key not in OPTION_KEYS:
            raise _unknown(key)
    lr = options.get("lr", DEFAULTS["lr"])
    weight_decay = options.get("weight_decay", DEFAULTS["wd"])
    beta1, beta2 = _betas(options.get("betas", DEFAULTS["adam_betas"]))
    eps = options.get("eps", DEFAULTS["adam_eps"])
    fused = options.get("fused", DEFAULTS["fused_adam"])
    if not isinstance(fused, bool):
        raise TorchtuneConfigError(f"{SECTION}.fused: invalid value {fused!r}; expected a bool")
    try:
        validate_job_optimizer(
            lr=lr, weight_decay=weight_decay, eps=eps, beta1=beta1, beta2=beta2, section=SECTION
        )
        muon = MuonConfig(**{k: v for k, v in options.items() if k in MUON_CONFIG_KEYS})
    except (TypeError, ValueError) as e:
        raise config_error(e) from None
    base = BaseHyperparams(
        lr=float(lr),
        weight_decay=float(weight_decay),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        fused=fused,
    )
    return OptimizerSection(base=base, muon=muon)
