"""The one mesh check the adapters share: a framework that builds its own device mesh over every
rank (or passes ``mesh=None`` to ``fully_shard``) can be judged only on the contract's 1-D mesh
over the whole world. Framework-free, so that any adapter can import it."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


def require_world_mesh(
    mesh: DeviceMesh, shard: str, why: str = "it shards on fully_shard's default mesh"
) -> None:
    """Refuse, naming ``shard`` and ``why`` the framework needs it, a mesh other than a 1-D one
    over every rank."""
    world = torch.distributed.get_world_size()
    if mesh.ndim != 1 or mesh.size() != world:
        raise ValueError(
            f"{shard} needs a 1-D mesh over all {world} ranks ({why}); got a mesh of shape "
            f"{tuple(mesh.shape)}"
        )
