"""The core library's two-rank scenarios, each one pytest test (real torchrun, real gloo)."""

from __future__ import annotations

import pytest

from tests.multirank import scenarios_core
from tests.multirank.harness import (
    RankOutcome,
    assert_scenario_passed,
    run_scenarios,
    scenario_names,
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[RankOutcome]]:
    return run_scenarios(scenarios_core.__name__, nproc=2)


@pytest.mark.parametrize("name", scenario_names(scenarios_core))
def test_scenario(name: str, outcomes: dict[str, list[RankOutcome]]) -> None:
    assert_scenario_passed(outcomes, name)
