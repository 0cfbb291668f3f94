"""The narrow wire protocol between the controller (the pytest process) and its ranks.

The controller listens on a localhost TCP socket (port 0, so the OS picks it) and passes the
address and a one-off token to the ranks through environment variables. Each rank connects back
once and identifies itself. After that the conversation is strictly lock-step:

    rank -> controller   hello(rank, local_rank, world_size, pid, token)
    rank -> controller   ready(collection_errors, observes)  once, after collecting its files
    controller -> rank   run(nodeid, next_nodeid, seed)      one test
    rank -> controller   report(nodeid, report)               per phase, as soon as it exists
                                                              (a passed one may wait for the
                                                              next message: see below)
    rank -> controller   waiting(nodeid, wait)                when the test's main thread has
                                                              been blocked in communication
                                                              for a while, and when that ends
    rank -> controller   done(nodeid, notes, problems, warnings, broken) | missing(nodeid, detail)
    controller -> rank   exit()                              end of the group's life

A frame is a 4-byte big-endian length followed by a UTF-8 JSON object with a ``type`` key.
Reports travel in pytest's own serialisable form (``pytest_report_to_serializable``), the same
form pytest-xdist uses, so the controller rebuilds genuine ``TestReport`` objects. ``waiting``
comes from a thread of the rank (:mod:`pytest_fp32keep.runner.waits`), never after the test's
``done``; a channel's sends are serialised so that frames of two threads never interleave.

A passed phase report changes nothing the controller decides, yet each frame that arrives alone
wakes it (and, on a busy machine, takes a CPU from the ranks). So the rank sends it corked
(Linux ``TCP_CORK``): the kernel holds it until the rank's next message goes out uncorked (the
next failure, a ``waiting``, ``done``), 200 ms at most, or the socket closes (the rank exits or
dies: the kernel sends what it holds before the end of stream). A passing test then reaches the
controller as one segment per rank, and a rank that hangs or dies after a passed phase still
tells which phase it passed, in time for every decision (those take seconds).

This module is imported by both sides; it uses the standard library only. The token a rank
sends in ``hello`` is the launch token of :mod:`pytest_fp32keep.runner.processes`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any, Final

Message = dict[str, Any]

#: Environment variables the controller sets for torchrun (and so for every rank).
ENV_CONTROLLER: Final = "FP32KEEP_CONTROLLER"  # "host:port" of the controller socket
ENV_RUN_DIR: Final = "FP32KEEP_RUN_DIR"  # per-launch folder: logs, stack dumps, basetemps
ENV_BACKEND: Final = "FP32KEEP_BACKEND"  # resolved backend: "gloo" or "nccl"
ENV_PG_TIMEOUT: Final = "FP32KEEP_PG_TIMEOUT"  # process-group timeout in seconds

HELLO: Final = "hello"
READY: Final = "ready"
RUN: Final = "run"
REPORT: Final = "report"
WAITING: Final = "waiting"
DONE: Final = "done"
MISSING: Final = "missing"
EXIT: Final = "exit"

_HEADER = struct.Struct(">I")
#: Linux's option that lets the kernel hold small writes back (None elsewhere: sent at once).
_CORK: Final = getattr(socket, "TCP_CORK", None)
#: A report with a long traceback and captured output stays far below this; the bound only
#: protects the controller from a corrupt length prefix.
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (for the controller: the rank process is gone)."""


class ProtocolError(RuntimeError):
    """A frame that this protocol does not produce arrived on the socket."""


def stack_file(run_dir: Path, rank: int) -> Path:
    """Where ``rank`` writes its Python stacks when it receives SIGUSR1."""
    return run_dir / f"stacks-rank{rank}.txt"


def rank_log(run_dir: Path, rank: int) -> Path:
    """Where ``rank`` sends its stdout and stderr (outside the per-test capture)."""
    return run_dir / f"rank{rank}.log"


def log_marker(nodeid: str) -> str:
    """The line a rank writes to its log before running ``nodeid``."""
    return f"=== fp32keep: running {nodeid} ==="


def rank_basetemp(run_dir: Path, rank: int) -> Path:
    """The ``--basetemp`` of ``rank``'s pytest session (so ``tmp_path`` never collides)."""
    return run_dir / f"basetemp-rank{rank}"


def encode(message: Message) -> bytes:
    """One frame for ``message``; values JSON cannot hold are sent as their ``repr``."""
    payload = json.dumps(message, default=repr).encode("utf-8")
    return _HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Turns a byte stream into messages; keeps partial frames between calls."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """Add ``data`` and return every message that is now complete."""
        buffer = self._buffer
        buffer += data
        messages: list[Message] = []
        start, size = 0, len(buffer)
        try:
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buffer, start)
                if length > MAX_FRAME_BYTES:
                    raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
                end = start + _HEADER.size + length
                if size < end:
                    break
                message = json.loads(buffer[start + _HEADER.size : end].decode("utf-8"))
                start = end
                if not isinstance(message, dict) or "type" not in message:
                    raise ProtocolError(f"frame is not a message: {message!r:.200}")
                messages.append(message)
        finally:
            del buffer[:start]  # once per read, not once per frame
        return messages


class Channel:
    """A framed, message-oriented view of one connected socket."""

    def __init__(self, sock: socket.socket) -> None:
        # Requests and reports are small writes answered at once: without TCP_NODELAY,
        # Nagle's algorithm and delayed ACKs add ~40 ms to every round trip.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self._corked = False  # a coalesced message is held back by the kernel
        # TCP_CORK, until the socket refuses it once (no TCP socket: a test's socketpair); then
        # None, so that it is not asked again for every coalesced message.
        self._cork_option: int | None = _CORK
        self._decoder = FrameDecoder()
        self._pending: list[Message] = []

    def fileno(self) -> int:
        """The socket's descriptor, so a channel can be registered with ``selectors``."""
        return self.sock.fileno()

    def send(self, message: Message, *, coalesce: bool = False) -> None:
        """Send one message (blocking, bounded by the socket's timeout; thread-safe).

        ``coalesce``: the kernel may hold it back until the next message sent without
        ``coalesce`` (200 ms at most, or until the socket closes), so that both reach the peer
        in one segment and wake it once (see the module docstring).
        """
        frame = encode(message)
        with self._send_lock:
            if coalesce and not self._corked:
                self._cork(True)
            self.sock.sendall(frame)
            if not coalesce and self._corked:
                self._cork(False)  # sends what was held and this frame, together

    def _cork(self, on: bool) -> None:
        if self._cork_option is None:
            return  # every frame goes at once
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, self._cork_option, int(on))
        except OSError:
            self._cork_option = None  # refused once, refused always: not asked again
            on = False
        self._corked = on

    def receive(self) -> Message:
        """Block until one message arrives (rank side: the controller paces the ranks)."""
        while not self._pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionClosed("controller closed the connection")
            self._pending.extend(self._decoder.feed(data))
        return self._pending.pop(0)

    def read_available(self) -> list[Message]:
        """After ``select`` reported the socket readable: read once, return whole messages.

        Raises ``ConnectionClosed`` at end of stream; messages that completed before the end
        are returned by the previous calls, never lost.
        """
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise ConnectionClosed(str(exc)) from exc
        if not data:
            raise ConnectionClosed("peer closed the connection")
        messages = self._pending + self._decoder.feed(data)
        self._pending = []
        return messages

    def close(self) -> None:
        """Close the socket; safe to call twice."""
        with contextlib.suppress(OSError):
            self.sock.close()


def hello(rank: int, local_rank: int, world_size: int, token: str) -> Message:
    """First message of a rank: who it is (the controller signals it by ``pid``)."""
    return {
        "type": HELLO,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "pid": os.getpid(),
        "token": token,
    }


def ready(collection_errors: list[str], *, observes: bool = False) -> Message:
    """The rank collected its files and initialised its process group.

    ``observes``: it will say when a test is blocked in communication (``waiting``); a rank
    that cannot is judged by its CPU time instead.
    """
    return {"type": READY, "collection_errors": collection_errors, "observes": observes}


def run(nodeid: str, next_nodeid: str | None, seed: int) -> Message:
    """Run one test; ``next_nodeid`` tells pytest which fixtures to keep for the next one."""
    return {"type": RUN, "nodeid": nodeid, "next_nodeid": next_nodeid, "seed": seed}


def report(nodeid: str, data: dict[str, Any]) -> Message:
    """One phase report, in pytest's serialisable form."""
    return {"type": REPORT, "nodeid": nodeid, "report": data}


def waiting(nodeid: str, wait: dict[str, Any] | None) -> Message:
    """The test's main thread is blocked in communication, or (``wait`` is ``None``) no longer.

    ``wait``: ``since`` (wall-clock seconds), ``where`` (the call or the collective, for the
    report) and ``ranks`` (the global ranks of the collective's process group, or ``None``
    where the rank cannot tell).
    """
    return {"type": WAITING, "nodeid": nodeid, "wait": wait}


def rank_warning(text: str, filename: str, lineno: int) -> dict[str, Any]:
    """One warning of a test in a rank (``"UserWarning: message"``) and where it was raised."""
    return {"text": text, "filename": filename, "lineno": lineno}


def done(
    nodeid: str,
    notes: list[str],
    *,
    problems: list[str] | None = None,
    warnings: list[dict[str, Any]] | None = None,
    broken: bool = False,
) -> Message:
    """The test finished on this rank.

    ``notes`` are rank-side remarks for the report; ``problems`` make the test an error on this
    rank (a fixture kept from an earlier test failed to tear down, the test destroyed the
    process group); ``warnings`` (:func:`rank_warning`) go to the parent's warnings summary, at
    the file and line where the rank raised them; ``broken`` says that the ranks cannot take
    another test.
    """
    return {
        "type": DONE,
        "nodeid": nodeid,
        "notes": notes,
        "problems": problems or [],
        "warnings": warnings or [],
        "broken": broken,
    }


def missing(nodeid: str, detail: str) -> Message:
    """The rank's own collection holds no test with this id."""
    return {"type": MISSING, "nodeid": nodeid, "detail": detail}


def exit_message() -> Message:
    """Finish the pytest session (session fixtures tear down) and leave."""
    return {"type": EXIT}
