"""The pytest process goes away mid-test: no process the plugin started survives it.

Two inner sessions, one for Ctrl-C and one for SIGKILL, are started together (their ranks start
side by side instead of one after the other), then each test ends one of them its way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.error_bounds import INTERRUPT_BOUND_S, note_elapsed
from tests.plugin._inner import TAG_VARIABLE, InnerProject, leftover_processes, new_tag

INNER_TESTS = """
import time
from collections.abc import Iterator

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


def start_inner_pytest(inner: InnerProject) -> subprocess.Popen[str]:
    """Start an inner pytest whose one marked test runs for ever."""
    inner.write(test_forever=INNER_TESTS)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_forever.py"],
        cwd=inner.path,
        env={**os.environ, TAG_VARIABLE: inner.tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A shell starts background jobs with SIGINT ignored, and children inherit that: give
        # the inner pytest the default handler, as an interactive Ctrl-C would find it.
        preexec_fn=_default_sigint,
    )


def wait_until_ranks_run(inner: InnerProject, process: subprocess.Popen[str]) -> None:
    """Return once both ranks are inside the test body; bounded."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(inner.records("started")) < 2:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = process.communicate()[0]
            pytest.fail(f"the ranks never started the test:\n{output}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def started(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[InnerProject, subprocess.Popen[str]]]]:
    """Both inner sessions, started together; each test waits for its own ranks."""
    projects = {
        name: InnerProject(tmp_path_factory.mktemp(name), new_tag())
        for name in ("ctrl-c", "sigkill")
    }
    running = {name: (inner, start_inner_pytest(inner)) for name, inner in projects.items()}
    yield running
    for inner, process in running.values():
        if process.poll() is None:
            process.kill()
            process.communicate()
        inner.kill_leftovers()


def gone_within_bound(inner: InnerProject, process: subprocess.Popen[str], sent: float) -> str:
    """Wait for the pytest process and every rank to end; the time it took is bounded."""
    output = process.communicate(timeout=INTERRUPT_BOUND_S)[0]
    left = leftover_processes(inner.tag, wait_s=INTERRUPT_BOUND_S)
    elapsed = time.monotonic() - sent
    assert left == [], left
    assert elapsed < INTERRUPT_BOUND_S, f"{elapsed:.1f} s until every process was gone"
    note_elapsed(elapsed)
    return output


def test_ctrl_c_kills_every_rank(
    started: dict[str, tuple[InnerProject, subprocess.Popen[str]]],
) -> None:
    inner, process = started["ctrl-c"]
    wait_until_ranks_run(inner, process)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    output = gone_within_bound(inner, process, sent)
    assert process.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt" in output


def test_ranks_end_when_the_pytest_process_is_killed_hard(
    started: dict[str, tuple[InnerProject, subprocess.Popen[str]]],
) -> None:
    # SIGKILL leaves no chance to clean up; the ranks notice that the controller's socket
    # closed (their watchdog thread) and leave, and torchrun follows them.
    inner, process = started["sigkill"]
    wait_until_ranks_run(inner, process)
    sent = time.monotonic()
    process.kill()
    gone_within_bound(inner, process, sent)
