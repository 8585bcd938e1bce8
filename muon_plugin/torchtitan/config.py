"""The ``[optimizer.muon]`` section of a torchtitan job config.

Enable it with one line in the TOML (or ``--job.custom_config_module muon_plugin.torchtitan``)::

    [job]
    custom_config_module = "muon_plugin.torchtitan"

    [optimizer]
    name = "muon"
    lr = 8e-4             # your AdamW lr: Muon groups default to lr_adjust = "match_rms_adamw"
    weight_decay = 0.1

    [optimizer.muon]
    orthogonalization = "polar_express"
    ns_steps = 5
    norm_weight_decay = 0.0
    embedding_lr = 3e-3
    output_patterns = ["output.*"]

Every field can be overridden on the command line (``--optimizer.muon.ns_steps 7``,
``--optimizer.muon.no-nesterov``, lists as ``a,b,c``) and is listed, with its docstring, by
``--help``. Torchtitan's own ``[optimizer]`` fields keep their meaning: ``lr`` and
``weight_decay`` are the defaults of every parameter class, ``beta1``/``beta2``/``eps`` those of
the AdamW groups, ``implementation = "fused"`` selects the fused Adam kernel.

Parameter classes (see :mod:`muon_plugin.param_groups.rules` for the default rules): ``matrix``,
``expert``, ``router``, ``embedding``, ``output``, ``norm``, ``other``; each has
``<class>_patterns``, ``<class>_algorithm``, ``<class>_lr`` and ``<class>_weight_decay``.
"""

# No "from __future__ import annotations": torchtitan merges these dataclasses by their field
# types (make_dataclass + is_dataclass), which must be real classes, not strings.
from dataclasses import dataclass, field

from muon_plugin.param_groups.options import MUON_CONFIG_KEYS, MuonConfig

__all__ = ["JobConfig", "MUON_CONFIG_KEYS", "MuonConfig", "Optimizer"]


@dataclass
class Optimizer:
    """Added to torchtitan's ``[optimizer]``, whose own fields (``name``, its default and
    choices included) stay as they are."""

    muon: MuonConfig = field(default_factory=MuonConfig)
    """Settings of optimizer.name = "muon"."""


@dataclass
class JobConfig:
    """Merged by torchtitan's ConfigManager into its JobConfig (job.custom_config_module)."""

    optimizer: Optimizer = field(default_factory=Optimizer)
