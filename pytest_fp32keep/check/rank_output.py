"""A rank's stdout, as ``fp32keep check`` passes it on: live, without gloo's connection lines.

torch 2.9's gloo (its rendezvous, built into ``libtorch_cpu.so``; torch 2.13's has no such line)
prints, from C++ to the process's stdout, one line per process group a rank joins::

    [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1

Every rank prints it for the default group and again for the contract's side group
(:mod:`pytest_fp32keep.contract.verdicts`), so it sat above and inside the table, wider than
the terminal, and interleaved mid-line when two ranks wrote at once. A Python hook cannot see
it (C++ writes to file descriptor 1), and the parent cannot match it exactly (the ranks share
the command's stdout), so each rank filters its own: :class:`GlooConnectedLines` makes fd 1 a
pipe that a thread reads and copies to the real stdout as it arrives, line by line, dropping
exactly that line. Only the line whose two counts agree is dropped: one that reports fewer peers
than expected, and gloo's ``is NOT connected to`` line after it, still reach the user.

Imports nothing of torch: it only moves bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading
from types import TracebackType
from typing import Final

#: gloo's line when a rank is connected to every peer of a group (both counts the same).
GLOO_CONNECTED: Final = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (?P<peers>\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : (?P=peers)"
)
#: How every gloo line begins: a partial line that may still become one is held back.
_GLOO_PREFIX: Final = b"[Gloo] "
#: How long leaving waits for the copying thread (a child process that inherited the pipe
#: keeps it open: the copy then stops where it is, the rank is not held up).
JOIN_TIMEOUT_S: Final = 5.0


class LineFilter:
    """The filter itself, on bytes as they arrive: :meth:`feed` returns what to pass on now.

    A complete line is dropped if it is gloo's connection line (:data:`GLOO_CONNECTED`, the
    whole line), passed on otherwise. A partial line is passed on at once, unless it may still
    become a gloo line (it begins like one): that is held until its end arrives.
    """

    def __init__(self) -> None:
        self._held = b""
        self._passing = False  # in a line already passed on in part: the rest goes too

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (and of what was held) to write now."""
        pending, out = self._held + data, bytearray()
        self._held = b""
        while pending:
            end = pending.find(b"\n")
            if self._passing:
                if end < 0:
                    out += pending
                    break
                out += pending[: end + 1]
                self._passing, pending = False, pending[end + 1 :]
            elif end >= 0:
                line, pending = pending[: end + 1], pending[end + 1 :]
                if not GLOO_CONNECTED.fullmatch(line.rstrip(b"\r\n")):
                    out += line
            elif pending.startswith(_GLOO_PREFIX) or _GLOO_PREFIX.startswith(pending):
                self._held = pending
                break
            else:
                out += pending
                self._passing = True
                break
        return bytes(out)

    def end(self) -> bytes:
        """What is still held when the output ends (a last line without its newline)."""
        held, self._held = self._held, b""
        return held if not GLOO_CONNECTED.fullmatch(held.rstrip(b"\r")) else b""


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (C++'s ``std::cout`` writes through them) into fd 1."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


class GlooConnectedLines:
    """Context manager: while inside, this process's fd 1 goes through a :class:`LineFilter`.

    On entering, fd 1 becomes the write end of a pipe; a daemon thread copies what arrives to
    the real stdout, filtered. On leaving, Python's and C's buffers are flushed, fd 1 is the
    real stdout again, and the thread passes on the rest (up to :data:`JOIN_TIMEOUT_S`).
    """

    def __init__(self) -> None:
        self._real = -1
        self._read = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GlooConnectedLines:
        sys.stdout.flush()
        _flush_c_stdio()
        self._real = os.dup(1)
        self._read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self._thread = threading.Thread(
            target=self._copy, name="fp32keep-stdout-filter", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        sys.stdout.flush()
        _flush_c_stdio()
        os.dup2(self._real, 1)  # the pipe's last write end here: the thread reads its end
        assert self._thread is not None
        self._thread.join(JOIN_TIMEOUT_S)
        if not self._thread.is_alive():
            os.close(self._read)
            os.close(self._real)

    def _copy(self) -> None:
        line_filter = LineFilter()
        with contextlib.suppress(OSError):  # the real stdout closed: nothing left to do
            while data := os.read(self._read, 65536):
                _write_all(self._real, line_filter.feed(data))
            _write_all(self._real, line_filter.end())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
