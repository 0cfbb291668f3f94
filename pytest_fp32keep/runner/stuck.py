"""Whether the ranks still running a test are stuck after one of their peers left it.

Controller side, pure (no sockets; :class:`CpuProgress` reads ``/proc``). Once a rank left the
test (failed, skipped, xfailed, or finished), a peer still running is either stuck in a
collective the departed rank will never join, or merely not done: it sleeps, waits on a child
process, reads a file, computes. The ranks say which (:mod:`pytest_fp32keep.runner.waits`):
each reports when its main thread has been blocked in communication, what in, since when, and,
for a collective the Flight Recorder names, the ranks of its process group. From that,
:func:`judge_blocked` finds the ranks stuck:

- a rank blocked for :data:`FAILURE_GRACE_S` in a collective whose process group holds a rank
  that left (which will never join it);
- or, where the group is not known (a blocking ``send``/``recv``, FSDP2 waiting on its own
  collectives), every rank still running blocked for :data:`FAILURE_GRACE_S`: none is left to
  unblock the others.

The grace counts from the later of the departure and the start of the wait. A rank running its
own code is waited for: only the test's timeout bounds it. A rank that cannot report (torch's
Flight Recorder off, ``TORCH_FR_BUFFER_SIZE=0``) is judged by :class:`CpuProgress` instead, the
rule before ranks could tell: no CPU used for :data:`FAILURE_GRACE_S`, and at most
:data:`PROGRESS_CAP_S` however busy (a rank that spins while it waits, as a CUDA
synchronisation can, is stuck all the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Final

from pytest_fp32keep.runner.processes import cpu_seconds
from pytest_fp32keep.runner.reports import ranks_text
from pytest_fp32keep.runner.waits import Blocked

#: How long a peer may stay blocked in communication after a rank left before it is stuck.
FAILURE_GRACE_S: Final = 3.0
#: A waiting rank that used this much CPU since the last sample is making progress (computing,
#: printing a lot). A rank blocked in a gloo collective uses about 0.01 s in 4 s (measured,
#: torch 2.13). Only for ranks that cannot report what they are blocked in.
PROGRESS_CPU_S: Final = 0.05
#: How often the CPU time of such ranks is sampled after one left early.
PROGRESS_SAMPLE_S: Final = 0.5
#: However busy, such a rank gets at most this long after the first rank left.
PROGRESS_CAP_S: Final = 120.0


@dataclasses.dataclass(frozen=True)
class Departure:
    """A rank that left the test: when (``time.time()``) and how ("failed", "finished", ...)."""

    at: float
    how: str


@dataclasses.dataclass(frozen=True)
class StuckRank:
    """A rank found stuck, or killed with those that are.

    Attributes:
        reason: what it was doing, for the report ("it was blocked in all_reduce (...), a
            collective of ranks 0,1 that rank 0 never joins").
        own_code_for: how long after the first departure it still ran its own code.
        blocked: it was blocked itself (not only killed with the ranks that were).
    """

    reason: str
    own_code_for: float = 0.0
    blocked: bool = True


def _departed_members(blocked: Blocked, left: Mapping[int, Departure]) -> list[int]:
    return [rank for rank in blocked.group_ranks or () if rank in left]


def judge_blocked(
    running: Sequence[int],
    blocked: Mapping[int, Blocked],
    left: Mapping[int, Departure],
    now: float,
) -> dict[int, StuckRank] | None:
    """Each running rank's account if they are stuck (see the module's rules), else ``None``.

    ``blocked`` holds what each running rank last said it is blocked in (absent: its own code),
    ``left`` the ranks that left the test; times are ``time.time()``.
    """
    if not left or not running:
        return None
    first_left = min(departure.at for departure in left.values())
    stuck: dict[int, StuckRank] = {}
    for rank in running:
        wait = blocked.get(rank)
        gone = _departed_members(wait, left) if wait is not None else []
        if wait is None or not gone:
            continue
        start = max(wait.since, min(left[r].at for r in gone))
        if now - start >= FAILURE_GRACE_S:
            group = ranks_text(wait.group_ranks or ())
            stuck[rank] = StuckRank(
                f"it was blocked in {wait.where}, a collective of {group} that "
                f"{ranks_text(gone)} never joins",
                own_code_for=max(0.0, wait.since - first_left),
            )
    if not stuck and all(rank in blocked for rank in running):
        starts = {rank: max(blocked[rank].since, first_left) for rank in running}
        if all(now - start >= FAILURE_GRACE_S for start in starts.values()):
            if len(running) == 1:
                alone = "and no other rank was left running to unblock it"
            else:
                alone = f"as was every rank still running ({ranks_text(running)})"
            for rank in running:
                stuck[rank] = StuckRank(
                    f"it was blocked in {blocked[rank].where}, {alone}",
                    own_code_for=starts[rank] - first_left,
                )
    if not stuck:
        return None
    along = StuckRank(
        f"it was running its own code when {ranks_text(stuck)} was found stuck", blocked=False
    )
    for rank in running:
        stuck.setdefault(rank, along)
    return stuck


class CpuProgress:
    """Whether ranks that cannot report what they wait in still use CPU: a peer that computes is
    slow, not stuck."""

    def __init__(self, pids: Mapping[int, int]) -> None:
        self._pids = dict(pids)
        self._cpu: dict[int, float] = {}
        self._sampled_at: float | None = None
        self.last_progress: float | None = None

    def sample(self, ranks: Sequence[int], now: float) -> None:
        """Take the ranks' CPU time every PROGRESS_SAMPLE_S; note when any of them grew."""
        if self._sampled_at is not None and now - self._sampled_at < PROGRESS_SAMPLE_S:
            return
        first = self._sampled_at is None
        self._sampled_at = now
        for rank in ranks:
            cpu = cpu_seconds(self._pids[rank]) if rank in self._pids else None
            if cpu is None:
                continue  # no /proc: the plain grace applies
            previous = self._cpu.get(rank)
            self._cpu[rank] = cpu
            if not first and previous is not None and cpu - previous >= PROGRESS_CPU_S:
                self.last_progress = now

    def stuck(self, ranks: Sequence[int], failure_seen: float, now: float) -> float | None:
        """After sampling ``ranks``: how long they kept computing, if they are now stuck (no
        progress for FAILURE_GRACE_S, or PROGRESS_CAP_S after the first rank left); else None.
        Times are ``time.monotonic()``."""
        self.sample(ranks, now)
        quiet_since = max(failure_seen, self.last_progress or failure_seen)
        if now >= quiet_since + FAILURE_GRACE_S or now >= failure_seen + PROGRESS_CAP_S:
            return quiet_since - failure_seen
        return None
