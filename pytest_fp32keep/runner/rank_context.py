"""What a rank knows about itself, shared by the rank session and the fixtures.

The rank session stores a :class:`RankContext` in ``config.stash`` before anything else runs;
the fixtures read it. Its absence is how a fixture knows it is in the plain pytest process,
where it must refuse with a clear message instead of building a process group.
"""

from __future__ import annotations

import dataclasses

import pytest


@dataclasses.dataclass(frozen=True)
class RankContext:
    """One rank of a group started by torchrun for ``@pytest.mark.fsdp2`` tests.

    Attributes:
        rank: global rank (``RANK`` from torchrun).
        local_rank: rank on this node (``LOCAL_RANK``); the CUDA device index under NCCL.
        world_size: number of ranks (``WORLD_SIZE``).
        backend: the initialised process-group backend, ``"gloo"`` or ``"nccl"``.
    """

    rank: int
    local_rank: int
    world_size: int
    backend: str

    @property
    def device_type(self) -> str:
        """The device type the backend works on: ``"cuda"`` for NCCL, ``"cpu"`` for gloo."""
        return "cuda" if self.backend == "nccl" else "cpu"

    @property
    def device_name(self) -> str:
        """This rank's device as a ``torch.device`` string (``"cuda:1"``, ``"cpu"``)."""
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else "cpu"


RANK_CONTEXT_KEY = pytest.StashKey[RankContext]()
