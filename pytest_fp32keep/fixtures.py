"""The contract's fixtures for tests marked ``@pytest.mark.fsdp2``: reference and probe.

This module is where the two rooms meet: the fixtures refuse outside the ranks through the
runner's :func:`~pytest_fp32keep.runner.fixtures.rank_context` and build the contract's
:func:`~pytest_fp32keep.contract.reference.build_unsharded_reference` and
:class:`~pytest_fp32keep.contract.probe.DtypeProbe`, imported inside the fixture bodies so that
loading the plugin costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_fp32keep.runner.fixtures import rank_context

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_fp32keep.contract.probe import DtypeProbe


@pytest.fixture
def unsharded_reference(
    request: pytest.FixtureRequest,
) -> Callable[..., nn.Module]:
    """A builder of the unsharded model a sharded one is compared against, on this rank.

    ``unsharded_reference(model_or_factory, dtype=None, *, seed=0, device=None,
    master_dtype=None)`` delegates
    to :func:`pytest_fp32keep.contract.reference.build_unsharded_reference` with this rank's device
    unless ``device`` is given: same starting weights, cast the same keep-aware way
    (``master_dtype=torch.float32``: then upcast to FP32 master weights, as stored before
    sharding).
    """
    context = rank_context(request)
    from pytest_fp32keep.contract.reference import build_unsharded_reference

    def build(
        model_or_factory: Any,
        dtype: torch.dtype | None = None,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        master_dtype: torch.dtype | None = None,
    ) -> nn.Module:
        target = context.device_name if device is None else device
        return build_unsharded_reference(
            model_or_factory, dtype, device=target, seed=seed, master_dtype=master_dtype
        )

    return build


@pytest.fixture
def dtype_probe(request: pytest.FixtureRequest) -> Iterator[Callable[..., DtypeProbe]]:
    """An attacher: ``dtype_probe(model, modules=None, **options)`` returns an attached
    :class:`pytest_fp32keep.contract.probe.DtypeProbe`; every probe it made is detached at teardown.
    """
    rank_context(request)
    from pytest_fp32keep.contract.probe import DtypeProbe

    probes: list[DtypeProbe] = []

    def attach(model: nn.Module, modules: Any = None, **options: Any) -> DtypeProbe:
        probe = DtypeProbe(model, modules, **options).attach()
        probes.append(probe)
        return probe

    yield attach
    for probe in probes:
        probe.detach()
