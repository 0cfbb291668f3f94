"""Ctrl-C on ``fp32keep check`` while its ranks run: one line, exit status 130, no traceback,
and no rank left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_fp32keep.check.cli import EXIT_INTERRUPTED
from tests.error_bounds import INTERRUPT_BOUND_S, note_elapsed
from tests.plugin._inner import TAG_VARIABLE, leftover_processes, new_tag, tagged_processes

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).with_name("fp32keep")
BATCH = ("--batch", "tests.cli.targets:toy_batch")


def test_ctrl_c_while_the_ranks_run_exits_130_with_one_line() -> None:
    tag = new_tag()
    env = {**os.environ, TAG_VARIABLE: tag}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = subprocess.Popen(
            [str(CONSOLE_SCRIPT), "check", "tests.cli.targets:slow_in_ranks", *BATCH],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            # torchrun and its 2 ranks (each sleeping in the target's factory)
            while len(tagged_processes(tag)) < 4 and time.monotonic() < deadline:
                assert command.poll() is None, "the command ended before its ranks started"
                time.sleep(0.2)
            time.sleep(1.0)  # well inside the wait for the ranks
            sent = time.monotonic()
            command.send_signal(signal.SIGINT)  # what the terminal's Ctrl-C sends
            status = command.wait(timeout=INTERRUPT_BOUND_S)
            note_elapsed(time.monotonic() - sent)
        finally:
            if command.poll() is None:
                command.kill()
        err.seek(0)
        stderr = err.read()
    assert status == EXIT_INTERRUPTED == 130, (status, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "fp32keep check: interrupted (Ctrl-C)", stderr
    assert leftover_processes(tag) == []
