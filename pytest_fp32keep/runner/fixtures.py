"""The runner's fixtures for tests marked ``@pytest.mark.fsdp2``: who am I, on which mesh.

They run inside the ranks. In the plain pytest process (an unmarked test) each of them fails
with a message that says so, instead of building a process group there (:func:`rank_context`,
which other fixture modules use for the same refusal). torch is imported inside the fixture
bodies, so loading the plugin costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pytest_fp32keep.runner.options import MARKER_NAME
from pytest_fp32keep.runner.rank_context import RANK_CONTEXT_KEY, RankContext

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


def rank_context(request: pytest.FixtureRequest) -> RankContext:
    """This rank's context, or a clear failure when the test does not run in ranks."""
    context = request.config.stash.get(RANK_CONTEXT_KEY, None)
    if context is None:
        # Session-scoped fixtures see the session as their node, which has no useful id.
        test = request.node.nodeid or "the test"
        pytest.fail(
            f"the fixture {request.fixturename!r} is available only inside tests marked "
            f"@pytest.mark.{MARKER_NAME} (their body runs in ranks started by torchrun, where "
            f"the process group exists); mark {test} with @pytest.mark.{MARKER_NAME} or "
            "stop requesting it.",
            pytrace=False,
        )
    return context


@pytest.fixture(scope="session")
def fsdp2_rank(request: pytest.FixtureRequest) -> int:
    """This rank's global rank (``RANK``)."""
    return rank_context(request).rank


@pytest.fixture(scope="session")
def fsdp2_world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks running the test (``WORLD_SIZE``)."""
    return rank_context(request).world_size


@pytest.fixture(scope="session")
def fsdp2_device(request: pytest.FixtureRequest) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, ``cpu`` under gloo."""
    context = rank_context(request)
    import torch

    return torch.device(context.device_name)


@pytest.fixture(scope="session")
def fsdp2_mesh(request: pytest.FixtureRequest) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over all ranks on the backend's device type.

    Session-scoped: built once per rank process over the default process group, which the
    rank session initialised before the first test.
    """
    context = rank_context(request)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(context.device_type, (context.world_size,))
