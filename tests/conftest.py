"""The suite's tiers: the default tier, and ``--slow`` for everything else.

``pytest`` runs the default tier: every feature at least once, in minutes on a 2-core machine.
``pytest --slow`` adds the tests marked ``@pytest.mark.slow``: breadth (every world size, every
family, every fault and launch variant) that the default tier covers with one representative
each. The nox sessions and the scheduled workflows pass ``--slow``; ``docs/ci.md`` says which run
where. Slow tests are deselected, never skipped, so a default run never counts them as passes.

The ranks of a marked test run their own pytest session, which must collect the test the parent
sends them whatever the parent's options (they do not inherit ``--slow``): the deselection is
the parent's alone.
"""

from __future__ import annotations

from typing import Final

import pytest

from pytest_fp32keep.runner.rank_context import RANK_CONTEXT_KEY

SLOW_OPTION: Final = "--slow"
SLOW_MARKER: Final = "slow"
SLOW_HELP: Final = (
    "also run the slow tier: tests marked @pytest.mark.slow (world-size sweeps, every family, "
    "every fault and launch variant); nox sessions and scheduled workflows pass it"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(SLOW_OPTION, action="store_true", default=False, help=SLOW_HELP)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SLOW_MARKER}: the slow tier, deselected unless {SLOW_OPTION} (tests/conftest.py)",
    )


def slow_tier_selected(config: pytest.Config) -> bool:
    """Whether this session runs the slow tier: ``--slow``, or inside a rank (which runs
    whatever it is sent)."""
    return bool(config.getoption(SLOW_OPTION)) or RANK_CONTEXT_KEY in config.stash


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if slow_tier_selected(config):
        return
    slow = [item for item in items if item.get_closest_marker(SLOW_MARKER) is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker(SLOW_MARKER) is None]
