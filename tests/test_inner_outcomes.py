"""An inner positive control must have passed: an error or a skip is not a pass.

The control of the check: the old reading (``case.find("failure") is None``) accepts the
erroring and the skipped inner test; :func:`tests.inner_outcomes.junit_outcomes` does not.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.inner_outcomes import assert_passed, junit_outcomes, run_inner_session

INNER = """
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("the fixture of a positive control raised")


def test_passes():
    pass


def test_fixture_errors(broken):
    pass


def test_skips():
    pytest.skip("not here")


def test_fails():
    assert False, "the implementation is wrong"


@pytest.fixture
def breaks_at_teardown():
    yield
    raise RuntimeError("teardown broke")


def test_fails_then_errors_at_teardown(breaks_at_teardown):
    assert False, "call failed"
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = tmp_path_factory.mktemp("outcomes")
    return run_inner_session(project, {"test_inner.py": INNER}, "-q", timeout=120).report


def test_each_inner_test_gets_its_real_outcome(report: Path) -> None:
    outcomes = junit_outcomes(report)
    assert {name: o.outcome for name, o in outcomes.items()} == {
        "test_passes": "passed",
        "test_fixture_errors": "error",
        "test_skips": "skipped",
        "test_fails": "failed",
        "test_fails_then_errors_at_teardown": "error",
    }
    assert "the fixture of a positive control raised" in outcomes["test_fixture_errors"].text
    assert "the implementation is wrong" in outcomes["test_fails"].text
    both = outcomes["test_fails_then_errors_at_teardown"].text
    assert "call failed" in both and "teardown broke" in both


def test_old_reading_took_an_error_or_a_skip_for_a_pass(report: Path) -> None:
    """The negative control of this check: what ``failure is None`` said of the same cases."""
    cases = {case.attrib["name"]: case for case in ET.parse(report).iter("testcase")}
    assert cases["test_fixture_errors"].find("failure") is None
    assert cases["test_skips"].find("failure") is None


@pytest.mark.parametrize("name", ["test_fixture_errors", "test_skips", "test_fails"])
def test_a_positive_control_that_did_not_pass_is_reported(report: Path, name: str) -> None:
    with pytest.raises(AssertionError, match=f"positive control {name} "):
        assert_passed(junit_outcomes(report)[name])


def test_a_positive_control_that_passed_is_accepted(report: Path) -> None:
    assert_passed(junit_outcomes(report)["test_passes"])


def test_an_inner_session_that_wrote_no_report_fails_with_its_output(tmp_path: Path) -> None:
    """A usage error stops pytest before any junit XML: the helper says so, not a bare
    ``FileNotFoundError`` from the parser."""
    with pytest.raises(AssertionError, match=r"exit 4\) wrote no junit report:[\s\S]*--no-such"):
        run_inner_session(tmp_path, {"test_inner.py": INNER}, "--no-such-option", timeout=120)
