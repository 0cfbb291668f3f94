"""Pre-dispatch: after a test passes, the next one of its ranks starts before the parent
decodes, merges or logs the first.

Each check reads evidence the inner tests leave in files (``rankrec``): a test that must not
run records itself if it does. The parent's hook in the inner conftest that decodes
``test_first``'s call report (``pytest_report_from_serializable``) waits until the ranks have
started ``test_second``: without pre-dispatch at ``done``, that never happens before the hook
returns (the decoding would come first), so the wait is the proof.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.error_bounds import INTERRUPT_BOUND_S
from tests.plugin._inner import TAG_VARIABLE, InnerProject, leftover_processes

#: How long the parent's decoding of ``test_first``'s call report waits for ``test_second``.
SECOND_START_WAIT_S = 120.0

WAIT_FOR_SECOND_CONFTEST = f"""
import os, time
from pathlib import Path

HERE = Path(__file__).parent
HOLD = os.environ.get("HOLD_AFTER_SECOND") == "1"


def pytest_report_from_serializable(data):
    # The parent decoding test_first's call report, as a rank serialised it.
    nodeid, when = data.get("nodeid", ""), data.get("when")
    if "RANK" in os.environ or when != "call" or not nodeid.endswith("::test_first"):
        return None
    deadline = time.monotonic() + {SECOND_START_WAIT_S}
    while time.monotonic() < deadline:
        if len(list((HERE / "records").glob("second_started.*"))) == 2:
            break
        time.sleep(0.05)
    started = len(list((HERE / "records").glob("second_started.*")))
    (HERE / "second_started_before_first_decoded.txt").write_text(str(started))
    while HOLD:  # the Ctrl-C check interrupts the parent here, test_second in flight
        time.sleep(0.1)
    return None  # pytest's own implementation decodes it
"""

COMMON = """
import time

import pytest
import torch
import torch.distributed as dist

from rankrec import record

pytestmark = pytest.mark.fsdp2


def ran(name):
    record(name)
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
"""

FLOW_TESTS = (
    COMMON
    + """

def test_first():
    ran("first")


def test_second():
    ran("second_started")


@pytest.mark.skip(reason="never runs")
def test_skip_marked():
    ran("skip_marked")


@pytest.mark.skipif(True, reason="never runs either")
def test_skipif_marked():
    ran("skipif_marked")


@pytest.mark.xfail(run=False, reason="not run")
def test_xfail_not_run():
    ran("xfail_not_run")


def test_after_skips():
    ran("after_skips")


def test_fails():
    record("fails")
    assert False


def test_after_failure():
    ran("after_failure")
"""
)

HOLD_TESTS = (
    COMMON
    + """

def test_first():
    ran("first")


def test_second():
    record("second_started")
    while True:
        time.sleep(0.1)
"""
)


def test_next_test_starts_before_the_passed_one_is_decoded(inner: InnerProject) -> None:
    inner.write(conftest=WAIT_FOR_SECOND_CONFTEST, test_flow=FLOW_TESTS)
    result = inner.run("test_flow.py", "-rA")
    result.assert_outcomes(passed=4, failed=1, skipped=2, xfailed=1)
    # (a) both ranks ran test_second before the parent decoded test_first's reports (let
    # alone merged or logged them): sent as soon as every rank's `done` said it passed.
    evidence = inner.path / "second_started_before_first_decoded.txt"
    assert evidence.read_text() == "2", result.stdout.str()
    # (b) skip-marked, skipif-true and xfail(run=False) successors never reach the ranks; the
    # test after them, and the one after a failure, run as usual.
    for name in ("skip_marked", "skipif_marked", "xfail_not_run"):
        assert inner.records(name) == [], name
    assert len(inner.records("after_skips")) == 2
    assert len(inner.records("after_failure")) == 2


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_next_test_is_sent_ahead_kills_every_rank(inner: InnerProject) -> None:
    inner.write(conftest=WAIT_FOR_SECOND_CONFTEST, test_hold=HOLD_TESTS)
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_hold.py"],
        cwd=inner.path,
        env={**os.environ, TAG_VARIABLE: inner.tag, "HOLD_AFTER_SECOND": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_sigint,
    )
    evidence = inner.path / "second_started_before_first_decoded.txt"
    deadline = time.monotonic() + 300.0
    while not evidence.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"test_second never started:\n{process.communicate()[0]}")
        time.sleep(0.2)
    assert evidence.read_text() == "2"
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=INTERRUPT_BOUND_S)[0]
    assert process.returncode == pytest.ExitCode.INTERRUPTED, output
    assert leftover_processes(inner.tag, wait_s=INTERRUPT_BOUND_S) == []
