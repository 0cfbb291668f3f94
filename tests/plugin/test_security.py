"""Nothing a session starts listens beyond loopback (docs/security.md), read from /proc.

Three views: the plugin's own ranks while a marked test runs, ``fp32keep check`` while its ranks
run, and a negative control: plain ``torchrun --standalone`` (what the runner used before), which
the same reader must catch listening on every interface.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.cli.test_cli import CONSOLE_SCRIPT, MARK_VARIABLE, ROOT, killed_leftovers
from tests.listeners import Listener, listeners, parent_of, process_tree

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)"
)

#: How long a launch may take to open its sockets on a loaded 2-core machine.
SOCKETS_BOUND_S = 60.0


def _wait_for_listeners(root: int, done: subprocess.Popen[bytes], minimum: int) -> list[Listener]:
    """Poll ``root``'s tree until it holds at least ``minimum`` listening sockets."""
    deadline = time.monotonic() + SOCKETS_BOUND_S
    found: list[Listener] = []
    while time.monotonic() < deadline and done.poll() is None:
        found = listeners(process_tree(root))
        if len(found) >= minimum:
            return found
        time.sleep(0.2)
    return found


@pytest.mark.fsdp2
def test_the_plugins_session_listens_on_loopback_only(fsdp2_world_size: int) -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # the process group and its gloo pairs are up
    dist.barrier()
    # rank -> torchrun -> the pytest process that runs the controller: scan everything below it
    controller = parent_of(parent_of(os.getpid()))
    found = listeners(process_tree(controller))
    assert found, "the reader saw no listening socket at all (gloo's pairs listen on loopback)"
    exposed = [str(listener) for listener in found if not listener.loopback]
    assert exposed == [], "listening beyond loopback:\n" + "\n".join(exposed)
    dist.barrier()  # no rank leaves while another still scans its sockets


def test_fp32keep_check_listens_on_loopback_only_and_ctrl_c_leaves_nothing(
    tmp_path: Path,
) -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK_VARIABLE: mark}
    with open(tmp_path / "out.txt", "wb") as out:
        cli = subprocess.Popen(
            [
                str(CONSOLE_SCRIPT),
                "check",
                "tests.cli.targets:slow_in_ranks",
                "--batch",
                "tests.cli.targets:toy_batch",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            # The ranks sleep in the factory after their process group is up: 2 gloo listeners
            found = _wait_for_listeners(cli.pid, cli, minimum=2)
            assert len(found) >= 2, (tmp_path / "out.txt").read_text()[-3000:]
            exposed = [str(listener) for listener in found if not listener.loopback]
            assert exposed == [], "listening beyond loopback:\n" + "\n".join(exposed)
            cli.send_signal(signal.SIGINT)  # Ctrl-C
            cli.wait(timeout=30)
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
    assert killed_leftovers(mark) == [], "a rank of the interrupted check was still running"


def test_negative_control_standalone_torchrun_is_caught_listening_everywhere(
    tmp_path: Path,
) -> None:
    """The reader can fail: ``torchrun --standalone`` keeps a TCPStore on every interface."""
    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(60)\n")
    torchrun = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            script,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        found = _wait_for_listeners(torchrun.pid, torchrun, minimum=1)
        assert [listener for listener in found if not listener.loopback], found
    finally:
        tree = process_tree(torchrun.pid)  # the worker has a session of its own: kill each
        for pid in reversed(tree):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        torchrun.wait()
