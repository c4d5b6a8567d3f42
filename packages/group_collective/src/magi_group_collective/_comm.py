"""Resolve the ``group`` argument (ProcessGroup, DeviceMesh or None) into the groups a backend uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Comm:
    """Process groups of one rank.

    Attributes:
        group: flat group over all ``W`` ranks; table ranks are ranks of this group.
        world_size: ``W``.
        rank: this rank in ``group``.
        mesh_shape: ``(num_nodes, ranks_per_node)`` when ``group`` was a 2-D DeviceMesh, else None.
            Table rank ``p`` is then mesh position ``(p // ranks_per_node, p % ranks_per_node)``.
        inter_group: ranks with this rank's intra-node index, one per node in node order (2-D mesh only).
        intra_group: the ranks of this rank's node in intra-node order (2-D mesh only).
    """

    group: dist.ProcessGroup
    world_size: int
    rank: int
    mesh_shape: tuple[int, int] | None = None
    inter_group: dist.ProcessGroup | None = None
    intra_group: dist.ProcessGroup | None = None


def as_device_mesh(obj: object, name: str = "group"):
    """``obj`` when it is a 1-D or 2-D ``(inter, intra)`` DeviceMesh, None when it is no DeviceMesh at all;
    ValueError naming ``name`` for a mesh of any other rank. The one mesh check of every magi package."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device_mesh
        return None
    if not isinstance(obj, DeviceMesh):
        return None
    if obj.ndim not in (1, 2):
        raise ValueError(f"`{name}`: a DeviceMesh must be 1-D or 2-D (inter, intra), got {obj.ndim}-D")
    return obj


def resolve_comm(group: object) -> Comm:
    """Build the :class:`Comm` for ``group`` (None = default group). No communication."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call init_process_group before a group collective"
        )
    if group is None or isinstance(group, dist.ProcessGroup):
        pg = group if group is not None else dist.group.WORLD
        return Comm(group=pg, world_size=dist.get_world_size(pg), rank=dist.get_rank(pg))
    mesh = as_device_mesh(group)
    if mesh is None:
        raise TypeError(f"`group` must be a ProcessGroup, a DeviceMesh or None, got {type(group).__name__}")
    if mesh.ndim == 1:
        pg = mesh.get_group()
        return Comm(group=pg, world_size=dist.get_world_size(pg), rank=dist.get_rank(pg))
    ranks = mesh.mesh.flatten().tolist()
    n_nodes, n_local = (int(s) for s in mesh.mesh.shape)
    if ranks == list(range(dist.get_world_size())):
        flat = dist.group.WORLD
    elif ranks == sorted(ranks) and hasattr(mesh, "_flatten"):
        flat = mesh._flatten().get_group()  # private but stable since torch 2.6; a sub-mesh of the world
    else:
        raise ValueError(
            f"`group` DeviceMesh ranks {ranks} must be increasing in (inter, intra) row-major order"
        )
    inter, intra = mesh.get_group(0), mesh.get_group(1)
    me = dist.get_rank(flat)
    node, local = divmod(me, n_local)
    # Group ranks are ordered by global rank; check they follow the mesh layout we index by.
    want_inter = [ranks[n * n_local + local] for n in range(n_nodes)]
    want_intra = [ranks[node * n_local + k] for k in range(n_local)]
    if dist.get_process_group_ranks(inter) != want_inter or dist.get_process_group_ranks(intra) != want_intra:
        raise ValueError("`group` DeviceMesh sub-groups do not follow the (inter, intra) row-major layout")
    return Comm(flat, n_nodes * n_local, me, (n_nodes, n_local), inter, intra)


def default_device(comm: Comm) -> torch.device:
    """The device of the group's tensors: the current CUDA device for NCCL, else CPU."""
    backend = str(dist.get_backend(comm.group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
