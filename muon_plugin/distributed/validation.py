"""Input validation: what the planner is given, refused early with the parameter's name.

:func:`place` turns a parameter (DTensor or plain tensor) into its domain and layout, refusing
layouts the plan cannot handle (``Partial`` or unknown placements, a mesh this rank is not part
of, a local shard that is not where the placements say).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from muon_plugin.distributed.groups import Domain, local_domain, mesh_domain
from muon_plugin.distributed.layout import Layout, LayoutError, layout_of


def _describe(p: Tensor, name: str, placements: Any = None, mesh_shape: Any = None) -> str:
    text = f"parameter {name!r} (shape {tuple(p.shape)}"
    if placements is not None:
        text += f", placements {tuple(placements)} on a mesh of shape {mesh_shape}"
    return text + ")"


class Placed(NamedTuple):
    """Where a parameter lives: its domain (the ranks of its mesh) and its layout."""

    domain: Domain
    layout: Layout


def place(p: Tensor, name: str, replicate_domain: Domain | None) -> Placed:
    """The domain and layout of parameter ``p`` (ValueError naming it when not supported).

    Plain tensors live on this rank alone, or, given ``replicate_domain`` (DDP), are replicated
    over it.
    """
    if not isinstance(p, DTensor):
        domain = replicate_domain if replicate_domain is not None else local_domain()
        layout = layout_of(
            tuple(p.shape), domain.mesh_shape, (Replicate(),) * len(domain.mesh_shape)
        )
        return Placed(domain, layout)
    mesh = p.device_mesh
    mesh_shape = tuple(mesh.mesh.shape)
    what = _describe(p, name, p.placements, mesh_shape)
    domain = mesh_domain(mesh)
    if domain is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(
            f"cannot orthogonalize {what}: rank {rank} is not part of its device mesh "
            f"{mesh.mesh.tolist()}"
        )
    try:
        layout = layout_of(tuple(p.shape), domain.mesh_shape, tuple(p.placements))
    except LayoutError as e:
        raise ValueError(
            f"cannot orthogonalize {what}: {e}. Muon needs whole matrices and will not "
            "orthogonalize a shard; redistribute the parameter (and its gradient) to "
            "Shard/_StridedShard/Replicate placements"
        ) from None
    expected = layout.local_shape(domain.me)
    actual = tuple(p.to_local().shape)
    if expected != actual:
        raise ValueError(
            f"cannot orthogonalize {what}: its local shard has shape {actual} but the "
            f"placements put {expected} on this rank (coordinate "
            f"{layout.coordinate(domain.me)}); padded or custom local layouts are not "
            "supported"
        )
    return Placed(domain, layout)
