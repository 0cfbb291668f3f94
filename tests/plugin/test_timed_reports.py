"""What a marked test's reports say about its time and its timeout (issue 36, item 6).

One inner session: a test that starts the ranks, a test that hangs until its marker's
``timeout=2``, and one that hangs until the session's ``-o fsdp_timeout=3`` (fresh ranks, as
after every hang). A hang names where its timeout came from; ``--durations`` and the JUnit
``time`` include the wait for a hung test and the ranks' start-up for the test that paid it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from tests.plugin._inner import InnerProject, failure_section

TESTS = """
import time

import pytest

from rankrec import record


@pytest.mark.fsdp2
def test_starts_the_ranks():
    record("body", at=time.time())


@pytest.mark.fsdp2(timeout=2)
def test_hangs_until_its_marker_timeout():
    while True:
        time.sleep(0.1)


@pytest.mark.fsdp2
def test_hangs_until_the_session_timeout():
    while True:
        time.sleep(0.1)
"""

#: The pytest process notes when each test's reporting began (the ranks do not log it).
CONFTEST = """
import os
import time

from rankrec import record


def pytest_runtest_logstart(nodeid, location):
    if "RANK" not in os.environ:
        record("logstart", nodeid=nodeid, at=time.time())
"""

DURATION_LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+test_timed\.py::(\w+)$")


class Run:
    """The inner session's output, read back."""

    def __init__(self, project: InnerProject, result: pytest.RunResult) -> None:
        self.project = project
        self.output = result.stdout.str()

    def section(self, test: str) -> str:
        return failure_section(self.output, test)

    def durations(self) -> dict[tuple[str, str], float]:
        """``--durations=0 -vv``: seconds per (test, phase)."""
        found = {}
        for line in self.output.splitlines():
            if match := DURATION_LINE.match(line.strip()):
                found[(match[3], match[2])] = float(match[1])
        return found

    def junit_times(self) -> dict[str, float]:
        root = ET.parse(self.project.path / "junit.xml").getroot()
        cases = root.iter("testcase")
        return {case.get("name", ""): float(case.get("time", "0")) for case in cases}


@pytest.fixture(scope="module")
def run(module_inner: InnerProject) -> Run:
    module_inner.write(test_timed=TESTS, conftest=CONFTEST)
    result = module_inner.run(
        "-vv", "--durations=0", "--junitxml=junit.xml", "-o", "fsdp_timeout=3", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=1, failed=2)
    return Run(module_inner, result)


def test_a_hang_names_the_marker_timeout_it_ran_into(run: Run) -> None:
    text = run.section("test_hangs_until_its_marker_timeout")
    assert "still running after 2 s (@pytest.mark.fsdp2(timeout=2))" in text, text
    assert "--fsdp-timeout" not in text and "fsdp_timeout" not in text  # it said --fsdp-timeout=2
    # negative control: the session's timeout is named as it was given, -o included
    text = run.section("test_hangs_until_the_session_timeout")
    assert "still running after -o fsdp_timeout=3 s" in text, text
    assert "timeout=2" not in text


def test_durations_show_how_long_a_hung_test_ran(run: Run) -> None:
    durations = run.durations()
    # the marker's 2 s, the session's 3 s: not "< 0.005s" (a report the ranks never sent)
    assert durations[("test_hangs_until_its_marker_timeout", "call")] >= 2.0, durations
    assert durations[("test_hangs_until_the_session_timeout", "call")] >= 3.0, durations
    # negative control: a test that passed at once is not charged a wait
    assert durations[("test_starts_the_ranks", "call")] < 2.0, durations


def test_junit_time_includes_the_start_of_the_ranks_for_the_test_that_started_them(
    run: Run,
) -> None:
    nodeid = "test_timed.py::test_starts_the_ranks"
    [logstart] = [r["at"] for r in run.project.records("logstart") if r["nodeid"] == nodeid]
    [body] = [r["at"] for r in run.project.records("body") if r["rank"] == "0"]
    waited_for_the_body = body - logstart  # the ranks' start-up, then the test's setup
    assert waited_for_the_body > 0.5, waited_for_the_body  # torchrun and torch take seconds
    times = run.junit_times()
    assert times["test_starts_the_ranks"] >= waited_for_the_body - 0.1, times
    durations = run.durations()
    started = durations[("test_starts_the_ranks", "setup")]
    assert started >= waited_for_the_body - 0.1, durations
    # negative control: the test that ran in ranks already started pays no start-up
    assert durations[("test_hangs_until_its_marker_timeout", "setup")] < started / 2, durations
