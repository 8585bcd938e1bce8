"""Release-independent param-group rules and the ``[optimizer.muon]`` option schema.

Imports without torchtitan: every front end (torchtitan releases, TorchTune, plain PyTorch)
builds its param groups from :mod:`.rules` and reads its options from :mod:`.options`.
"""

from muon_plugin.param_groups.groups import build_param_groups, muon_param_groups
from muon_plugin.param_groups.options import MUON_CONFIG_KEYS, MuonConfig

__all__ = ["MUON_CONFIG_KEYS", "MuonConfig", "build_param_groups", "muon_param_groups"]
