"""Multi-rank tests run in the plugin's torchrun ranks (``@pytest.mark.fsdp2``)."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import DeviceMesh


@pytest.fixture
def mesh(fsdp2_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every rank (the plugin's ``fsdp2_mesh``)."""
    return fsdp2_mesh
