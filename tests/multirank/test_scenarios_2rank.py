"""Two-rank scenarios of the core library and of the contract, each one pytest test.

Each scenario module runs in one real ``torchrun`` (gloo, 2 ranks) the first time one of its
scenarios is asked for; every ``scenario_*`` function is then one test.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.multirank import scenarios_contract, scenarios_core
from tests.multirank.harness import (
    RankOutcome,
    assert_scenario_passed,
    run_scenarios,
    scenario_names,
)

MODULES: tuple[ModuleType, ...] = (scenarios_core, scenarios_contract)
CASES = [
    pytest.param(module.__name__, name, id=f"{module.__name__.rsplit('.', 1)[-1]}:{name}")
    for module in MODULES
    for name in scenario_names(module)
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, list[RankOutcome]]]:
    return {}


@pytest.mark.parametrize(("module", "name"), CASES)
def test_scenario(
    module: str, name: str, outcomes: dict[str, dict[str, list[RankOutcome]]]
) -> None:
    if module not in outcomes:
        outcomes[module] = run_scenarios(module, nproc=2)
    assert_scenario_passed(outcomes[module], name)
