"""Fixtures for tests marked ``@pytest.mark.fsdp2``; they run inside the ranks.

In the plain pytest process (an unmarked test) each of them fails with a message that says
so, instead of building a process group there. torch, the probe and the reference builder are
imported inside the fixture bodies, so loading the plugin costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_fp32keep.options import MARKER_NAME
from pytest_fp32keep.rank_context import RANK_CONTEXT_KEY, RankContext

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from pytest_fp32keep.probe import DtypeProbe


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


@pytest.fixture
def unsharded_reference(
    request: pytest.FixtureRequest,
) -> Callable[..., nn.Module]:
    """A builder of the unsharded model a sharded one is compared against, on this rank.

    ``unsharded_reference(model_or_factory, dtype=None, *, seed=0, device=None)`` delegates
    to :func:`pytest_fp32keep.reference.build_unsharded_reference` with this rank's device
    unless ``device`` is given: same starting weights, cast the same keep-aware way.
    """
    context = rank_context(request)
    from pytest_fp32keep.reference import build_unsharded_reference

    def build(
        model_or_factory: Any,
        dtype: torch.dtype | None = None,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        target = context.device_name if device is None else device
        return build_unsharded_reference(model_or_factory, dtype, device=target, seed=seed)

    return build


@pytest.fixture
def dtype_probe(request: pytest.FixtureRequest) -> Iterator[Callable[..., DtypeProbe]]:
    """An attacher: ``dtype_probe(model, modules=None, **options)`` returns an attached
    :class:`pytest_fp32keep.probe.DtypeProbe`; every probe it made is detached at teardown.
    """
    rank_context(request)
    from pytest_fp32keep.probe import DtypeProbe

    probes: list[DtypeProbe] = []

    def attach(model: nn.Module, modules: Any = None, **options: Any) -> DtypeProbe:
        probe = DtypeProbe(model, modules, **options).attach()
        probes.append(probe)
        return probe

    yield attach
    for probe in probes:
        probe.detach()
