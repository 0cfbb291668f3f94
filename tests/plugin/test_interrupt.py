"""The pytest process goes away mid-test: no process the plugin started survives it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.error_bounds import INTERRUPT_BOUND_S, note_elapsed
from tests.plugin._inner import InnerProject, leftover_processes

INNER_TESTS = """
import time

import pytest

from rankrec import record


@pytest.mark.fsdp2
def test_runs_for_ever():
    record("started")
    while True:
        time.sleep(0.1)
"""

#: Starting the ranks may take long on a loaded machine; the wait is bounded all the same.
START_TIMEOUT_S = 300.0


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_until_ranks_run(inner: InnerProject) -> subprocess.Popen[str]:
    """Start an inner pytest and return once both ranks are inside the test body."""
    inner.write(test_forever=INNER_TESTS)
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_forever.py"],
        cwd=inner.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A shell starts background jobs with SIGINT ignored, and children inherit that: give
        # the inner pytest the default handler, as an interactive Ctrl-C would find it.
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(inner.records("started")) < 2:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = process.communicate()[0]
            pytest.fail(f"the ranks never started the test:\n{output}")
        time.sleep(0.2)
    return process


def gone_within_bound(inner: InnerProject, process: subprocess.Popen[str], sent: float) -> str:
    """Wait for the pytest process and every rank to end; the time it took is bounded."""
    output = process.communicate(timeout=INTERRUPT_BOUND_S)[0]
    left = leftover_processes(inner.tag, wait_s=INTERRUPT_BOUND_S)
    elapsed = time.monotonic() - sent
    assert left == [], left
    assert elapsed < INTERRUPT_BOUND_S, f"{elapsed:.1f} s until every process was gone"
    note_elapsed(elapsed)
    return output


def test_ctrl_c_kills_every_rank(inner: InnerProject) -> None:
    process = start_until_ranks_run(inner)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    output = gone_within_bound(inner, process, sent)
    assert process.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt" in output


def test_ranks_end_when_the_pytest_process_is_killed_hard(inner: InnerProject) -> None:
    # SIGKILL leaves no chance to clean up; the ranks notice that the controller's socket
    # closed (their watchdog thread) and leave, and torchrun follows them.
    process = start_until_ranks_run(inner)
    sent = time.monotonic()
    process.kill()
    gone_within_bound(inner, process, sent)
