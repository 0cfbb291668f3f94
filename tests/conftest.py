"""The suite's tiers: the default tier, and ``--slow`` for everything else.

``pytest`` runs the default tier: every feature at least once, in minutes on a 2-core machine.
``pytest --slow`` adds the tests marked ``@pytest.mark.slow``: breadth (every world size, every
family, every fault and launch variant) that the default tier covers with one representative
each. The nox sessions and the scheduled workflows pass ``--slow``; ``docs/ci.md`` says which run
where. Slow tests are deselected, never skipped, so a default run never counts them as passes.

Under pytest-xdist (``--dist=loadfile``, pyproject's ``addopts``) a worker takes whole modules in
collection order, so a long module collected last runs alone at the end while the other worker
idles. :data:`LONG_POLES` are collected first (longest first), and the short modules fill in
beside them. That order holds only with ``--no-loadscope-reorder`` (also in ``addopts``):
pytest-xdist 3.8 otherwise hands out modules by their number of tests, most first, which put
the faults (20 tests, the longest setup) about 110 s into the run.

The ranks of a marked test run their own pytest session, which must collect the test the parent
sends them whatever the parent's options (they do not inherit ``--slow``): the deselection is
the parent's alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from pytest_fp32keep.runner.rank_context import RANK_CONTEXT_KEY

SLOW_OPTION: Final = "--slow"
SLOW_MARKER: Final = "slow"
SLOW_HELP: Final = (
    "also run the slow tier: tests marked @pytest.mark.slow (world-size sweeps, every family, "
    "every fault and launch variant); nox sessions and scheduled workflows pass it"
)

LONG_POLES: Final = (
    "tests/plugin/test_faults.py",
    "tests/plugin/test_lockstep.py",
    "tests/cli/test_cli.py",
    "tests/plugin/test_failure_messages.py",
    "tests/plugin/test_compat.py",
    "tests/contract/test_negative_controls.py",
    "tests/test_packaging.py",
    "tests/plugin/test_launch.py",
    "tests/plugin/test_security.py",
    "tests/plugin/test_hygiene.py",
    "tests/probe/test_probe_fsdp.py",
    "tests/plugin/test_interrupt.py",
)
"""The default tier's longest modules, longest first, as ``pytest --durations=30`` ranks them
(the figures: bench/RESULTS.md, "Test-suite runs"); the order only decides when each starts.
tests/test_suite_order.py checks that each still exists."""


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


def long_poles_first(items: list[pytest.Item], rootpath: Path) -> list[pytest.Item]:
    """``items`` with the modules of :data:`LONG_POLES` first, in that order; otherwise as
    collected (a stable sort: the tests of a module keep their order)."""
    rank = {module: index for index, module in enumerate(LONG_POLES)}

    def key(item: pytest.Item) -> int:
        try:
            module = item.path.relative_to(rootpath).as_posix()
        except ValueError:  # collected from outside the repository
            return len(rank)
        return rank.get(module, len(rank))

    return sorted(items, key=key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if RANK_CONTEXT_KEY in config.stash:  # a rank runs what it is sent, in the parent's order
        return
    items[:] = long_poles_first(items, config.rootpath)
    if slow_tier_selected(config):
        return
    slow = [item for item in items if item.get_closest_marker(SLOW_MARKER) is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker(SLOW_MARKER) is None]
