"""Communication domains: the ranks a parameter's shards live on, and a process group over them.

A *domain* is the set of ranks of a parameter's device mesh, listed by linear mesh index
(row-major over the mesh coordinates). Orthogonalization traffic for a parameter runs over one
process group spanning the whole domain:

- a 1-D mesh: its own group;
- a mesh covering every rank of the job: the default (world) group;
- a flattened mesh already registered on the root mesh with the same ranks: its group;
- otherwise a new group over exactly the domain's ranks, created with
  ``use_local_synchronization=True`` so that only its members take part (pipeline stages holding
  different sub-meshes do not have to make matching calls), cached per rank set.

``mesh._flatten()`` is not used: it creates groups for every slice of the root mesh and so needs
every rank of the job to call it in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

# (id of the default group, sorted ranks) -> group made here.
_GROUPS: dict[tuple[int, tuple[int, ...]], ProcessGroup] = {}


@dataclass(frozen=True)
class Domain:
    """The ranks (global, by linear mesh index) and mesh shape a parameter is laid out on."""

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    me: int  # this process's linear index
    source: DeviceMesh | ProcessGroup | None = field(default=None, compare=False, hash=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


def local_domain() -> Domain:
    """A domain of this process alone (plain tensors that are not replicated)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return Domain((rank,), (1,), 0, None)


def mesh_domain(mesh: DeviceMesh) -> Domain | None:
    """The domain of ``mesh``, or None when this process is not part of it."""
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    shape = tuple(int(s) for s in mesh.mesh.shape)
    me = 0
    for c, s in zip(coord, shape, strict=True):
        me = me * s + int(c)
    return Domain(ranks, shape, me, mesh)


def group_domain(group: ProcessGroup | DeviceMesh) -> Domain:
    """The domain of a process group (or 1-D mesh) that plain tensors are replicated over."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"replicate_group must be a 1-D mesh or a process group, got {group}")
        domain = mesh_domain(group)
        if domain is None:
            raise ValueError("this rank is not part of replicate_group")
        return domain
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_group_rank(group, dist.get_rank())
    return Domain(ranks, (len(ranks),), me, group)


def process_group(domain: Domain) -> ProcessGroup | None:
    """A process group over exactly ``domain.ranks`` (None for a one-rank domain)."""
    if domain.size == 1:
        return None
    source = domain.source
    if isinstance(source, ProcessGroup):
        return source
    if isinstance(source, DeviceMesh) and source.ndim == 1:
        return source.get_group(0)
    wanted = sorted(domain.ranks)
    if wanted == list(range(dist.get_world_size())):
        return dist.distributed_c10d._get_default_group()
    if isinstance(source, DeviceMesh):
        root = source._get_root_mesh()
        for flat in getattr(root, "_flatten_mapping", {}).values():
            if flat.get_coordinate() is not None and sorted(flat.mesh.flatten().tolist()) == wanted:
                return flat.get_group(0)
    key = (id(dist.distributed_c10d._get_default_group()), tuple(wanted))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks=wanted, use_local_synchronization=True)
    return _GROUPS[key]


def group_ranks_of(domain: Domain, group: ProcessGroup | None) -> list[int]:
    """For each linear index of ``domain``, the rank of that process inside ``group``
    (the linear index itself when there is no group: nothing is sent)."""
    if group is None:
        return list(range(domain.size))
    return [dist.get_group_rank(group, r) for r in domain.ranks]
