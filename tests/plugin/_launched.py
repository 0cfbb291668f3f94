"""Helpers for inner pytest sessions run by an external launcher: torchrun as if on two nodes.

Each ``torchrun`` is started in its own session, with its output going to a file (two pipes
read one after the other could fill up and stall), bounded by a deadline, and killed with its
whole process group afterwards whatever happened; its processes carry the inner project's tag,
so the caller can check that none is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.plugin._inner import TAG_VARIABLE

#: What each process runs unless told: pytest, without the cache (ranks would share it).
PYTEST = ("-m", "pytest", "-p", "no:cacheprovider")
#: Bound on one launched inner session (4 ranks importing torch on a small machine).
LAUNCHED_TIMEOUT_S = 480.0


@dataclasses.dataclass(frozen=True)
class LaunchedRun:
    """What every torchrun of one launched session returned and wrote."""

    returncodes: list[int]
    outputs: list[str]

    @property
    def combined(self) -> str:
        """Every torchrun's output (its workers' included), one after the other."""
        return "\n".join(self.outputs)


def free_loopback_port() -> int:
    """A port on 127.0.0.1 nothing listens on right now (the rendezvous binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def torchrun_command(
    nnodes: int,
    nproc: int,
    node_rank: int,
    port: int,
    run_id: str,
    args: list[str],
    program: tuple[str, ...] = PYTEST,
) -> list[str]:
    """``torchrun`` for one node of a c10d rendezvous on loopback, running ``program``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        *program,
        *args,
    ]


def run_launched(
    project: Path,
    tag: str,
    args: list[str],
    *,
    nnodes: int = 2,
    nproc: int = 2,
    timeout: float = LAUNCHED_TIMEOUT_S,
    program: tuple[str, ...] = PYTEST,
) -> LaunchedRun:
    """Run ``program`` (pytest) in ``project`` under ``nnodes`` torchruns of ``nproc`` workers
    each."""
    port = free_loopback_port()
    env = {**os.environ, TAG_VARIABLE: tag, "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    logs = [project / f"torchrun-node{node}.log" for node in range(nnodes)]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for node, log in enumerate(logs):
            command = torchrun_command(nnodes, nproc, node, port, tag, args, program)
            with open(log, "wb") as out:
                processes.append(
                    subprocess.Popen(
                        command,
                        cwd=project,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            time.sleep(0.5)  # node 0 first: it hosts the rendezvous store
        deadline = time.monotonic() + timeout
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    outputs = [log.read_text(errors="replace") for log in logs]
    for node, output in enumerate(outputs):
        print(f"===== torchrun node {node} =====\n{output}")  # shown when a check fails
    return LaunchedRun([process.returncode for process in processes], outputs)
