"""Rank side: whether the test's main thread is blocked in communication, told to the controller.

After one rank left a test (finished, failed, skipped), the controller must tell a peer that is
blocked in a collective the departed rank will never join (stuck: kill it within seconds) from
one that runs its own code (sleeps, waits on a child process, reads a file, computes: wait for
it, up to the test's timeout). CPU time cannot tell them apart: a sleeping rank and one blocked
in a gloo collective both use none. So each rank watches its own main thread, where pytest runs
the test, and says when it has been blocked in communication for a while.

A thread (:class:`CommunicationWatch`) samples the main thread every :data:`WATCH_POLL_S` while
a test runs. The main thread counts as *blocked* when its innermost Python frame has not moved
between two samples (the same frame at the same instruction: a call into C that has not
returned) and either

- that frame is torch.distributed's own code: a blocking c10d call (``all_reduce``,
  ``barrier``, ``send``/``recv``, the ``*_object`` collectives), FSDP2 waiting on its
  all-gathers and reduce-scatters (issued from ``_fsdp_collectives.py``, waited on from its
  autograd hooks), a functional collective's ``wait_tensor`` (DTensor); or
- torch's Flight Recorder holds a collective this rank issued during the test that has not
  completed: a ``work.wait()`` in the test's own code, or, under NCCL, where collectives run
  asynchronously, a host thread spinning in a CUDA synchronisation behind one. The recorder
  also names that collective's process group, and so the ranks that must join it.

The recorder's cheap per-group status (its dumps, read through :mod:`.c10d_recorder`, with
``includeCollectives=False``: tens of microseconds) is read first; the entries themselves (a few
hundred milliseconds for torch's 2000 entries under gloo) only when that status says something
may be pending while the main thread stands still, and once per status. The status alone cannot
be trusted under gloo, whose concurrent collectives can complete out of order and leave "last
completed" behind for good (measured, torch 2.13); each entry's ``retired`` flag is exact.

A wait is reported (:func:`~pytest_fp32keep.runner.protocol.waiting`) once it has lasted one
sample, and its end once it ends, so a test whose collectives complete promptly sends nothing.
The rank's ``ready`` message says whether the recorder works here at all
(:func:`flight_recorder_works`); where it does not (``TORCH_FR_BUFFER_SIZE=0``), the controller
keeps judging that rank by its CPU time.

The recorder's size comes from the environment, read once per process, and its default differs
between torch releases: 2000 entries in torch 2.13 and 2.14, 0 (nothing recorded, gloo's
collectives included) in torch 2.9 (``torch/csrc/distributed/c10d/FlightRecorder.hpp``). So the
launcher gives the ranks torch 2.13's default where the user set neither of torch's size
variables (:func:`flight_recorder_environment`), and the watch works the same on every torch;
a size the user chose, ``0`` included, is kept.

torch is imported only when the watch is made, after the process group is initialised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from types import FrameType
from typing import Any, Final

from pytest_fp32keep.runner import protocol
from pytest_fp32keep.runner.c10d_groups import group_names
from pytest_fp32keep.runner.c10d_recorder import FlightRecorderError, recorder_dumps

#: How often the watch samples the main thread while a test runs (and how long a wait lasts
#: before it is reported).
WATCH_POLL_S: Final = 0.25
#: The watch's thread function, by which stack dumps recognise (and drop) its thread.
WATCH_THREAD_FUNCTION: Final = "_watch_main_thread"

#: torch's variables for the Flight Recorder's size, the name it prefers first (torch reads both,
#: and the first one set wins).
FLIGHT_RECORDER_SIZE_VARIABLES: Final = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: The size the ranks get where the user set none: torch 2.13's default (torch 2.9's is 0).
FLIGHT_RECORDER_ENTRIES: Final = 2000


def flight_recorder_environment(env: MutableMapping[str, str]) -> None:
    """Give the ranks' environment ``env`` a Flight Recorder of :data:`FLIGHT_RECORDER_ENTRIES`
    entries, unless it names a size already (the user's choice, ``0`` included, is kept)."""
    if not any(name in env for name in FLIGHT_RECORDER_SIZE_VARIABLES):
        env[FLIGHT_RECORDER_SIZE_VARIABLES[0]] = str(FLIGHT_RECORDER_ENTRIES)


@dataclasses.dataclass(frozen=True)
class Blocked:
    """What the main thread is blocked in, and since when (``time.time()``)."""

    since: float
    where: str
    group_ranks: tuple[int, ...] | None = None  # the collective's process group, if known

    @classmethod
    def from_message(cls, wait: Mapping[str, Any]) -> Blocked:
        """Read back the wire form (controller side)."""
        ranks = wait.get("ranks")
        group = tuple(int(rank) for rank in ranks) if ranks is not None else None
        return cls(float(wait["since"]), str(wait["where"]), group)

    def to_message(self) -> dict[str, Any]:
        """The wire form (:func:`~pytest_fp32keep.runner.protocol.waiting`)."""
        ranks = list(self.group_ranks) if self.group_ranks is not None else None
        return {"since": self.since, "where": self.where, "ranks": ranks}


def _dump_functions() -> list[Callable[..., Any]]:
    """The Flight Recorder's dumps (:mod:`.c10d_recorder`); none on a torch without them."""
    try:
        return recorder_dumps()
    except FlightRecorderError:  # judged by CPU time, as with the recorder switched off
        return []


def _read_dump(dump: Callable[..., Any], include_collectives: bool) -> dict[str, Any]:
    """One Flight Recorder dump, decoded; empty when it cannot be read."""
    try:
        raw = dump(include_collectives, True)  # (includeCollectives, onlyActive)
        data = json.loads(raw)
    except Exception:  # a recorder that cannot be read says nothing, it does not break a test
        return {}
    return data if isinstance(data, dict) else {}


def _pg_status(dumps: list[Callable[..., Any]]) -> dict[str, tuple[int, int]]:
    """Per process group of each recorder: (last enqueued, last completed) collective."""
    status: dict[str, tuple[int, int]] = {}
    for index, dump in enumerate(dumps):
        groups = _read_dump(dump, include_collectives=False).get("pg_status", {})
        for group, fields in groups.items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                status[f"{index}:{group}"] = (
                    int(fields["last_enqueued_collective"]),
                    int(fields["last_completed_collective"]),
                )
    return status


def flight_recorder_works() -> bool:
    """Whether torch's Flight Recorder records this rank's collectives (one barrier to see).

    Called once, right after the default process group is made, on every rank (the barrier is
    a collective). False with the recorder switched off (``TORCH_FR_BUFFER_SIZE=0``, torch 2.9's
    default where :func:`flight_recorder_environment` did not set the size) or on a torch
    without it.
    """
    import torch.distributed as dist

    dist.barrier()
    return any(enqueued >= 1 for enqueued, _ in _pg_status(_dump_functions()).values())


def _group_ranks(name: str) -> tuple[int, ...] | None:
    """The global ranks of the process group called ``name`` in this rank, if it knows it."""
    import torch.distributed as dist

    try:
        for group, group_name in group_names().items():
            if group_name == name:
                return tuple(dist.get_process_group_ranks(group))
    except Exception:  # private bookkeeping of torch: without it the group is unknown
        return None
    return None


class _Recorder:
    """This rank's collectives that have not completed, from the Flight Recorder."""

    def __init__(self) -> None:
        self._dumps = _dump_functions()
        self._checked: dict[str, tuple[int, int]] | None = None  # status of the last look
        self._found: Blocked | None = None  # what that look found

    def pending(self, test_started: float, *, fresh: bool) -> Blocked | None:
        """The oldest collective issued since ``test_started`` that has not completed.

        ``fresh``: the thread stands still somewhere new, so what the last look found may be
        over even though the status reads the same ("last completed" can stay behind after
        the collective completed): read the entries again.
        """
        status = _pg_status(self._dumps)
        if not any(enqueued > completed for enqueued, completed in status.values()):
            self._checked, self._found = status, None
            return None
        if status == self._checked and not fresh:
            return self._found  # the same stall, nothing enqueued or completed since
        oldest: dict[str, Any] | None = None
        for dump in self._dumps:
            for entry in _read_dump(dump, include_collectives=True).get("entries", []):
                created = entry.get("time_created_ns", 0) / 1e9
                if entry.get("retired", True) or created < test_started:
                    continue
                if oldest is None or created < oldest["time_created_ns"] / 1e9:
                    oldest = entry
        self._checked, self._found = status, None
        if oldest is not None:
            group = (oldest.get("process_group") or ["?"])[0]
            self._found = Blocked(
                since=oldest["time_created_ns"] / 1e9,
                where=(
                    f"{oldest.get('profiling_name', 'a collective')} (collective "
                    f"#{oldest.get('collective_seq_id', '?')} of process group {group!r})"
                ),
                group_ranks=_group_ranks(str(group)),
            )
        return self._found


def _in_torch_distributed(frame: FrameType, package: str) -> str | None:
    """Where ``frame`` is, when it is torch.distributed's code: ``all_reduce (torch/...:N)``."""
    filename = frame.f_code.co_filename
    if not filename.startswith(package):
        return None
    relative = "torch" + os.sep + "distributed" + os.sep + filename[len(package) :]
    return f"{frame.f_code.co_name} ({relative}:{frame.f_lineno})"


def _same(one: Blocked | None, other: Blocked | None) -> bool:
    if one is None or other is None:
        return one is other
    return one.where == other.where


class BlockedSampler:
    """What one thread is blocked in, from samples taken at intervals (rules: the module's).

    Each :meth:`sample` compares the thread's innermost frame and instruction with the previous
    sample's: a thread that moved is running (``None``); one that stood still is blocked in
    torch.distributed's code, or in a collective the Flight Recorder holds as pending, or
    neither (``None``: its own code, e.g. a sleep).
    """

    def __init__(self, thread_id: int) -> None:
        import torch.distributed

        self._thread_id = thread_id
        self._package = os.path.dirname(torch.distributed.__file__) + os.sep
        self._recorder = _Recorder()
        self._last: tuple[int, int] | None = None  # frame and instruction at the last sample
        self._last_at = 0.0
        self._consulted: tuple[int, int] | None = None  # where the recorder was last asked

    def reset(self) -> None:
        """Forget the previous sample (a new test begins)."""
        self._last = None
        self._consulted = None

    def sample(self, issued_since: float) -> Blocked | None:
        """One sample; collectives issued before ``issued_since`` (``time.time()``) are old."""
        frame = sys._current_frames().get(self._thread_id)
        now = time.time()
        here = (id(frame), frame.f_lasti) if frame is not None else None
        still = here is not None and here == self._last
        previous_at, self._last, self._last_at = self._last_at, here, now
        if frame is None or not still:
            return None
        where = _in_torch_distributed(frame, self._package)
        if where is not None:
            return Blocked(since=previous_at, where=where)
        fresh, self._consulted = here != self._consulted, here
        return self._recorder.pending(issued_since, fresh=fresh)


class CommunicationWatch:
    """A thread that reports when the main thread is blocked in communication during a test.

    ``begin``/``end`` bracket each test (called by the main thread; they only set a field and
    wake the thread). Between tests the thread sleeps. With ``observes`` false (no Flight
    Recorder) it never starts: the controller judges this rank by its CPU time.
    """

    def __init__(self, channel: protocol.Channel, *, observes: bool) -> None:
        self.observes = observes
        self._channel = channel
        self._main = threading.main_thread().ident or 0
        self._lock = threading.Lock()  # guards _test; held while a report is sent
        self._test: tuple[str, float] | None = None  # (nodeid, wall-clock start)
        self._wake = threading.Event()

    def start(self) -> None:
        """Start the watching thread (a daemon: it never holds the rank up at exit)."""
        if self.observes:
            thread = threading.Thread(
                target=self._watch_main_thread, name="fp32keep-communication-watch", daemon=True
            )
            thread.start()

    def begin(self, nodeid: str) -> None:
        """The main thread starts running ``nodeid``."""
        with self._lock:
            self._test = (nodeid, time.time())
        self._wake.set()

    def end(self) -> None:
        """The test is over: after this returns, nothing more is sent about it."""
        with self._lock:
            self._test = None

    def _watch_main_thread(self) -> None:
        sampler = BlockedSampler(self._main)
        while True:
            self._wake.wait()
            self._wake.clear()
            with contextlib.suppress(Exception):  # the watch must never take the rank down
                self._watch_tests(sampler)

    def _watch_tests(self, sampler: BlockedSampler) -> None:
        """Sample the main thread until no test runs; report each change of what blocks it."""
        watched: tuple[str, float] | None = None
        reported: Blocked | None = None
        while True:
            time.sleep(WATCH_POLL_S)
            test = self._test
            if test is None:
                return
            if test != watched:  # a test began (possibly the next one, within one sample)
                watched, reported = test, None
                sampler.reset()
            blocked = sampler.sample(issued_since=test[1])
            if _same(blocked, reported):
                continue  # nothing new: still running its own code, or the same wait goes on
            if not self._send(test[0], blocked):
                return
            reported = blocked

    def _send(self, nodeid: str, blocked: Blocked | None) -> bool:
        """Report ``blocked`` (``None``: the wait ended) if ``nodeid`` still runs."""
        with self._lock:
            if self._test is None or self._test[0] != nodeid:
                return False
            wait = blocked.to_message() if blocked is not None else None
            try:
                self._channel.send(protocol.waiting(nodeid, wait))
            except OSError:
                return False  # the controller is gone; the watchdog ends the rank
        return True
