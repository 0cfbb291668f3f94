"""Ranks that never start (inherited plugins and rank-only collection errors: test_lockstep.py)."""

from __future__ import annotations

from tests.plugin._inner import InnerProject, failure_section, leftover_processes


def test_ranks_that_cannot_start_fail_their_tests_and_are_not_retried_for_ever(
    inner: InnerProject,
) -> None:
    inner.write(
        conftest="""
        import os

        if "RANK" in os.environ:
            os._exit(5)  # every rank dies while its pytest session loads this conftest
        """,
        test_marked="""
        import pytest

        pytestmark = pytest.mark.fsdp2

        def test_one():
            pass

        def test_two():
            pass

        def test_three():
            pass
        """,
        test_unmarked="""
        def test_plain():
            pass
        """,
    )
    result = inner.run("-rA")
    result.assert_outcomes(passed=1, errors=3)
    first = failure_section(result.stdout.str(), "test_one")
    assert "fsdp2: could not start 2 ranks (gloo): torchrun exited with code 1" in first
    assert "exitcode  : 5" in first  # torchrun's own account, from its log
    assert "could not start 2 ranks" in failure_section(result.stdout.str(), "test_two")
    third = failure_section(result.stdout.str(), "test_three")
    assert "not starting 2 gloo ranks again: the last 2 attempts failed" in third
    assert leftover_processes(inner.tag) == []
