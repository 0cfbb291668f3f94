"""Frames that no rank of ours sends, arriving on the controller's start-up listener from another
local process, are refused (the connection closed) and the ranks still start: never an internal
error of pytest-fp32keep (docs/security.md: the listener is on loopback, open to local users)."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from pytest_fp32keep.runner import protocol
from pytest_fp32keep.runner.launcher import LaunchSpec, RankGroup

TEST_FILE = """
import pytest


@pytest.mark.fsdp2
def test_nothing():
    pass
"""


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def message(**fields: object) -> bytes:
    return frame(json.dumps(fields).encode())


#: What a stranger sends; each on a connection of its own.
MALFORMED = {
    "not-json": frame(b"\xff\xfe not json"),
    "too-long": struct.pack(">I", protocol.MAX_FRAME_BYTES + 1),
    "not-a-message": frame(b"[1, 2, 3]"),
    "hello-without-token": message(type=protocol.HELLO, rank=0, pid=1),
    "hello-wrong-token": message(type=protocol.HELLO, rank=0, pid=1, token="guess"),
    "ready-before-hello": message(type=protocol.READY, collection_errors=[]),
    "unknown-type": message(type="run", nodeid="x"),
}


def _children() -> set[str]:
    """The pids of this process's children (a warm rank group of an earlier test included)."""
    children = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[-1].split()[1]) == os.getpid():
                children.add(entry.name)
    return children


def _controller_address(deadline: float, earlier: set[str]) -> tuple[str, int]:
    """The listener's address, read from the environment of the torchrun we started (not one
    of ``earlier``: an earlier test's warm ranks in this worker, whose listener is closed)."""
    marker = protocol.ENV_CONTROLLER.encode() + b"="
    while time.monotonic() < deadline:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or entry.name in earlier:
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[-1].split()[1]) != os.getpid():
                    continue
                environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            for item in environ:
                if item.startswith(marker):
                    host, _, port = item[len(marker) :].decode().rpartition(":")
                    return host, int(port)
        time.sleep(0.02)
    raise AssertionError("no torchrun child carrying the controller's address")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
def test_malformed_frames_are_refused_and_the_ranks_still_start(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(TEST_FILE)
    spec = LaunchSpec(
        nproc=2,
        backend="gloo",
        files=(str(tmp_path / "test_x.py"),),
        pytest_args=("-p", "no:cacheprovider"),
        cwd=tmp_path,
        run_dir=tmp_path / "run",
        pg_timeout=60,
        ready_timeout=120,
    )
    outcome: dict[str, object] = {}

    def start() -> None:
        try:
            outcome["group"] = RankGroup.start(spec)
        except BaseException as exc:  # what the controller would turn into an internal error
            outcome["error"] = exc

    earlier = _children()
    starter = threading.Thread(target=start)
    starter.start()
    refused = {}
    try:
        address = _controller_address(time.monotonic() + 60, earlier)
        for name, data in MALFORMED.items():
            with socket.create_connection(address, timeout=30) as stranger:
                stranger.sendall(data)
                refused[name] = stranger.recv(1) == b""  # closed by the controller
    finally:
        starter.join(timeout=180)
        group = outcome.get("group")
        if isinstance(group, RankGroup):
            group.kill()
    assert "error" not in outcome, f"the start failed: {outcome['error']!r}"
    assert isinstance(group, RankGroup) and sorted(group.ranks) == [0, 1]
    assert refused == dict.fromkeys(MALFORMED, True), refused
