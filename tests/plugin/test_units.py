"""Pure parts of the engine, checked without processes: argument inheritance, torchrun's
failure summary, stack condensing, and the merge rules on hand-made rank reports."""

from __future__ import annotations

from typing import Literal

import pytest

from pytest_fp32keep.runner import options, reports, tracebacks
from pytest_fp32keep.runner.launcher import parse_torchrun_failures

INFO = reports.ItemInfo(
    nodeid="test_x.py::test_y",
    location=("test_x.py", 3, "test_y"),
    keywords={"test_y": 1},
    where=lambda: ("/p/test_x.py", 4),
)


def report(
    when: reports.Phase,
    outcome: Literal["passed", "failed", "skipped"],
    longrepr: str | tuple[str, int, str] | None = None,
    stop: float = 1.0,
    **extra: object,
) -> pytest.TestReport:
    made = pytest.TestReport(
        INFO.nodeid, INFO.location, INFO.keywords, outcome, longrepr, when, stop=stop, start=0.5
    )
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def ranks(*phases: list[pytest.TestReport]) -> list[reports.RankOutcome]:
    return [
        reports.RankOutcome(rank=i, reports=list(p), finished=True) for i, p in enumerate(phases)
    ]


def passed_all() -> list[pytest.TestReport]:
    return [report("setup", "passed"), report("call", "passed"), report("teardown", "passed")]


@pytest.mark.parametrize(
    ("args", "inherited"),
    [
        (
            ["-p", "myplugin", "-pother", "--import-mode=importlib"],
            ["-p", "myplugin", "-p", "other", "--import-mode", "importlib"],
        ),
        (
            ["-o", "xfail_strict=true", "-o", "addopts=-x", "--override-ini=cache_dir=/x"],
            ["-o", "xfail_strict=true"],
        ),
        (
            ["-W", "error", "--tb", "short", "--strict-markers", "--runxfail"],
            ["-W", "error", "--tb", "short", "--strict-markers", "--runxfail"],
        ),
        (["-x", "-k", "not slow", "--lf", "-n", "2", "--junitxml", "out.xml", "-v", "tests/"], []),
        (["--timeout=30", "-s", "--maxfail=2", "-m", "gpu", "--fsdp-nproc=4"], []),
    ],
)
def test_ranks_inherit_only_what_shapes_collection_and_fixtures(
    args: list[str], inherited: list[str]
) -> None:
    assert options._filter_inherited(args) == inherited


def test_torchrun_failure_summary_is_parsed() -> None:
    text = """
Failures:
[1]:
  time      : 2026-11-29_12:23:28
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 7226)  (SIGTERM)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_12:23:28
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 7227)
"""
    exits = parse_torchrun_failures(text)
    assert exits[1].exitcode == 3 and exits[1].root_cause
    assert exits[1].describe() == "exited with code 3"
    assert exits[0].terminated_by_torchrun and not exits[0].root_cause
    assert exits[0].describe() == "killed by signal 15 (SIGTERM)"


def test_stacks_lose_the_watchdog_thread_and_pytest_frames() -> None:
    dump = """Thread 0x00007f384c9ff6c0 (most recent call first):
  File "/x/pytest_fp32keep/runner/rank_session.py", line 220 in watch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f384df1eb80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/t/test_f.py", line 9 in test_it
  File "/x/_pytest/python.py", line 187 in pytest_pyfunc_call
  File "/x/pluggy/_callers.py", line 103 in _multicall
"""
    assert tracebacks.condense_stacks(dump) == (
        "Current thread (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/t/test_f.py", line 9 in test_it\n'
        "  ... 2 frames of pytest and the rank session"
    )


def test_all_ranks_passing_is_one_passing_report_per_phase() -> None:
    merged = reports.merge(INFO, ranks(passed_all(), passed_all()))
    assert [(r.when, r.outcome) for r in merged] == [
        ("setup", "passed"),
        ("call", "passed"),
        ("teardown", "passed"),
    ]


def test_earliest_failure_is_the_root_cause() -> None:
    late = [
        report("setup", "passed"),
        report("call", "failed", "late", stop=9.0),
        report("teardown", "passed"),
    ]
    early = [
        report("setup", "passed"),
        report("call", "failed", "early", stop=2.0),
        report("teardown", "passed"),
    ]
    call = reports.merge(INFO, ranks(late, early))[1]
    assert call.failed
    text = call.longreprtext
    assert "root cause: rank 1 (first to fail)" in text
    assert text.index("early") < text.index("late")


def test_a_rank_killed_as_a_consequence_is_never_the_root_cause() -> None:
    outcomes = ranks(passed_all()[:1], passed_all()[:1])
    outcomes[0].fault = reports.RankFault("stuck", "waited", at=1.0, consequence=True)
    outcomes[1].fault = reports.RankFault("died", "exited with code 3", at=5.0)
    merged = reports.merge(INFO, outcomes)
    assert [(r.when, r.outcome) for r in merged] == [
        ("setup", "passed"),
        ("call", "failed"),
        ("teardown", "passed"),
    ]
    assert "root cause: rank 1 (first to fail)" in merged[1].longreprtext
    assert merged[1].longrepr.reprcrash.message == "[rank 1] exited with code 3"  # type: ignore[union-attr]


def test_a_skip_on_some_ranks_only_is_a_failure() -> None:
    skipped = [
        report("setup", "passed"),
        report("call", "skipped", ("f", 1, "Skipped: no")),
        report("teardown", "passed"),
    ]
    merged = reports.merge(INFO, ranks(passed_all(), skipped))
    assert merged[1].failed
    assert "rank 1 skipped in call while rank 0 ran it" in merged[1].longreprtext


def test_a_skip_on_every_rank_is_a_skip() -> None:
    skipped = [report("setup", "skipped", ("f", 1, "Skipped: no")), report("teardown", "passed")]
    merged = reports.merge(INFO, ranks(skipped, skipped))
    assert [(r.when, r.outcome) for r in merged] == [("setup", "skipped"), ("teardown", "passed")]
    assert merged[0].longrepr == ("f", 1, "Skipped: no")


def test_expected_failure_on_some_ranks_and_non_strict_pass_on_others_is_xfail() -> None:
    xfailed = [
        report("setup", "passed"),
        report("call", "skipped", "boom", wasxfail="why"),
        report("teardown", "passed"),
    ]
    xpassed = [
        report("setup", "passed"),
        report("call", "passed", wasxfail="why"),
        report("teardown", "passed"),
    ]
    call = reports.merge(INFO, ranks(xfailed, xpassed))[1]
    assert call.skipped and call.wasxfail == "why"


def test_a_rank_that_hung_in_call_is_charged_to_call_even_if_setup_failed_elsewhere() -> None:
    broken_setup = [
        report("setup", "failed", "fixture broke", stop=1.0),
        report("teardown", "passed"),
    ]
    hung = reports.RankOutcome(rank=1, reports=[report("setup", "passed")])
    hung.fault = reports.RankFault("stuck", "did not finish", at=2.0, consequence=True, stack="S")
    merged = reports.merge(INFO, [reports.RankOutcome(0, broken_setup, True), hung])
    assert [(r.when, r.outcome) for r in merged] == [("setup", "failed"), ("teardown", "passed")]
    text = merged[0].longreprtext
    assert "fixture broke" in text and "did not finish" in text


def test_output_of_every_rank_is_kept_in_named_sections() -> None:
    def with_output(rank: int) -> list[pytest.TestReport]:
        call = report("call", "passed", sections=[("Captured stdout call", f"out {rank}")])
        call.sections = [("Captured stdout call", f"out {rank}")]
        return [report("setup", "passed"), call, report("teardown", "passed")]

    call = reports.merge(INFO, ranks(with_output(0), with_output(1)))[1]
    assert call.sections == [
        ("Captured stdout call [rank 0]", "out 0"),
        ("Captured stdout call [rank 1]", "out 1"),
    ]
    assert call.capstdout == "out 0out 1"


def test_an_xfail_whose_peers_got_stuck_because_of_it_is_still_an_xfail() -> None:
    xfailed = [report("setup", "passed"), report("call", "skipped", "boom", wasxfail="known")]
    stuck = reports.RankOutcome(rank=0, reports=[report("setup", "passed")])
    stuck.fault = reports.RankFault("stuck", "waited for rank 1", at=2.0, consequence=True)
    merged = reports.merge(INFO, [stuck, reports.RankOutcome(1, xfailed, True)])
    call = merged[1]
    assert call.skipped and call.wasxfail == "known"
    assert ("fsdp2 [rank 0]", "waited for rank 1") in call.sections


def test_a_skip_that_left_a_peer_stuck_is_a_failure_naming_the_skipping_rank() -> None:
    skipped = [report("setup", "passed"), report("call", "skipped", ("f", 1, "Skipped: idle"))]
    stuck = reports.RankOutcome(rank=0, reports=[report("setup", "passed")])
    stuck.fault = reports.RankFault(
        "stuck", "waited", summary="stuck after rank 1 skipped", at=2.0, consequence=True
    )
    call = reports.merge(INFO, [stuck, reports.RankOutcome(1, skipped, True)])[1]
    assert call.failed
    text = call.longreprtext
    assert "call failed on rank 0 of 2 (rank 1 skipped)" in text
    assert "no rank failed by itself: stuck after rank 1 skipped" in text
    assert "skipped: idle" in text


def test_a_death_outranks_a_peer_error_reported_just_before_it_was_seen() -> None:
    peer_error = [report("setup", "passed"), report("call", "failed", "closed by peer", stop=10.0)]
    died = reports.RankOutcome(rank=1, reports=[report("setup", "passed")])
    died.fault = reports.RankFault("died", "exited with code 3", at=10.2)
    call = reports.merge(INFO, [reports.RankOutcome(0, peer_error, True), died])[1]
    assert "root cause: rank 1 (first to fail)" in call.longreprtext
