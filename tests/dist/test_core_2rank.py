"""The core library's two-rank scenarios, each one pytest test (real torchrun, real gloo)."""

from __future__ import annotations

import pytest

from tests.dist import scenarios_core
from tests.dist.harness import RankOutcome, run_scenarios

SCENARIOS = sorted(name for name in vars(scenarios_core) if name.startswith("scenario_"))


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[RankOutcome]]:
    return run_scenarios("tests.dist.scenarios_core", nproc=2)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(name: str, outcomes: dict[str, list[RankOutcome]]) -> None:
    ranks = outcomes.get(name)
    assert ranks is not None, f"{name} did not run (an earlier scenario may have hung the ranks)"
    assert len(ranks) == 2, f"{name} ran on ranks {[r.rank for r in ranks]} only"
    failed = [r for r in ranks if not r.ok]
    assert not failed, "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in failed)
