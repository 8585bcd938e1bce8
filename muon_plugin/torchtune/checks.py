"""Recipe settings Muon cannot run with, refused before any process group or model exists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from muon_plugin.torchtune.options import TorchtuneConfigError

__all__ = ["check_recipe_config"]


def check_recipe_config(cfg: Mapping[str, Any]) -> None:
    """Raise :class:`TorchtuneConfigError` naming the key of a setting Muon cannot honour.

    ``optimizer_in_bwd: true`` makes torchtune build one optimizer per parameter and step it
    inside the backward pass; Muon orthogonalizes whole matrices whose shards and gradients
    come from every rank, in one step over all parameters.
    """
    if cfg.get("optimizer_in_bwd", False):
        raise TorchtuneConfigError(
            f"optimizer_in_bwd: {cfg.get('optimizer_in_bwd')!r} is not supported with Muon (it "
            "steps one optimizer per parameter inside the backward pass; Muon updates whole "
            "matrices in one optimizer step): set optimizer_in_bwd: false"
        )
