"""The opt-in world-size sweep of gradient parity: marker ``parity_sweep``.

Tests marked ``@pytest.mark.parity_sweep`` (the full 1/2/3/4/8-rank sweep of
``test_parity_world_sizes.py``) are deselected unless ``FP32KEEP_PARITY_SWEEP=1``: they start up to
eight ranks per world size, minutes on a CPU runner, and the default suite keeps one fast odd
world size (3 ranks) instead. Run the sweep with::

    FP32KEEP_PARITY_SWEEP=1 pytest tests/contract/test_parity_world_sizes.py
"""

from __future__ import annotations

import os

import pytest

SWEEP_ENV = "FP32KEEP_PARITY_SWEEP"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"parity_sweep: the world-size sweep of gradient parity, deselected unless {SWEEP_ENV}=1",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SWEEP_ENV) == "1":
        return
    sweep = [item for item in items if item.get_closest_marker("parity_sweep") is not None]
    if sweep:
        config.hook.pytest_deselected(items=sweep)
        items[:] = [item for item in items if item.get_closest_marker("parity_sweep") is None]
