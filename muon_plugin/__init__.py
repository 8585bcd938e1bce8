"""muon_plugin: a fast, DTensor-native, distributed Muon optimizer and a torchtitan plugin."""

from muon_plugin.optimizer import Muon, MuonForeach
from muon_plugin.orthogonalize import zeropower
from muon_plugin.param_groups.groups import muon_param_groups

__all__ = ["Muon", "MuonForeach", "MuonLP", "muon_param_groups", "zeropower"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # MuonLP needs torchao (the `lp` extra): import it only when asked for.
    if name == "MuonLP":
        from muon_plugin.lp import MuonLP

        return MuonLP
    raise AttributeError(f"module 'muon_plugin' has no attribute {name!r}")
