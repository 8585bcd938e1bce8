"""Print, as JSON, the param groups one ``[optimizer.muon]`` TOML file gives on the installed
torchtitan release (0.2.2: the job TOML through ``build_muon_optimizers``; 0.3: the container's
``muon_toml`` option), for a small model whose parameter names cover every class.

    python tests/titan03/groups_dump.py FILE.toml
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from types import SimpleNamespace

import torch
import torch.nn as nn


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.tok_embeddings = nn.Embedding(32, 8)
    layer = nn.Module()
    layer.attention = nn.Module()
    layer.attention.wq = nn.Linear(8, 8, bias=False)
    layer.attention.wo = nn.Linear(8, 8, bias=True)
    layer.attention_norm = nn.RMSNorm(8)
    layer.moe = nn.Module()
    layer.moe.experts = nn.Module()
    layer.moe.experts.w1 = nn.Parameter(torch.randn(4, 16, 8))
    layer.moe.router = nn.Module()
    layer.moe.router.gate = nn.Linear(8, 4, bias=False)
    layer.sinks = nn.Parameter(torch.zeros(2))
    m.layers = nn.ModuleDict({"0": layer})
    m.norm = nn.RMSNorm(8)
    m.output = nn.Linear(8, 32, bias=False)
    return m


def _jsonable(v):
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def dump(container) -> dict:
    groups = []
    for opt, classes in zip(container.optimizers, container.group_classes, strict=True):
        for g, c in zip(opt.param_groups, classes, strict=True):
            groups.append({"class": c, **{k: _jsonable(v) for k, v in g.items() if k != "params"}})
    return {"optimizer": type(container.optimizers[0]).__name__, "groups": groups}


def main(path: str) -> None:
    job = tomllib.loads(open(path).read())
    if importlib.util.find_spec("torchtitan.config.override") is not None:
        from muon_plugin.torchtitan03.container import MuonOptimizersContainer

        o = job["optimizer"]
        config = MuonOptimizersContainer.Config(
            lr=o["lr"],
            weight_decay=o["weight_decay"],
            eps=o.get("eps", 1e-8),
            beta1=o.get("beta1", 0.9),
            beta2=o.get("beta2", 0.95),
            muon_toml=path,
        )
        container = config.build(model_parts=[model()])
    else:
        from torchtitan.config import ConfigManager

        from muon_plugin.torchtitan.builder import build_muon_optimizers

        cfg = ConfigManager().parse_args(["--job.config_file", path])
        container = build_muon_optimizers(
            [model()], cfg.optimizer, SimpleNamespace(ep_enabled=False, pp_enabled=False)
        )
    print("GROUPS" + json.dumps(dump(container), sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
