"""Ranks that are stopped (SIGSTOP, a debugger's stop) while a test is in flight.

Controller side. A stopped rank never answers, and its peers wait for it in their next
collective; without a look at the process it would be found only at ``--fsdp-timeout``, as a
hang. :class:`StoppedWatch` reads each running rank's state from ``/proc/PID/stat`` twice a
second once the test has run :data:`SAMPLE_S`, and names the ranks that stayed stopped for
:data:`STOPPED_GRACE_S` (the grace lets a sampling profiler's brief attach, ``py-spy dump``,
pass). Where ``/proc`` cannot be read nothing is found, and the timeout applies as before.

SIGTSTP, SIGTTIN and SIGTTOU do not stop a rank: each rank leads a session of its own (torch
elastic starts it so), an orphaned process group, and the kernel discards those three signals
there. SIGSTOP cannot be discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from pytest_fp32keep.runner.processes import process_state

#: How long a rank must stay stopped before the test fails naming it.
STOPPED_GRACE_S: Final = 2.0
#: How often the running ranks' states are read (the first read comes this long after the start:
#: a test that takes less never reads ``/proc`` at all).
SAMPLE_S: Final = 0.5

#: The stopped states of ``/proc/PID/stat`` and what each means, for the report.
STOPPED_STATES: Final = {
    "T": "stopped by a signal (SIGSTOP: process state T)",
    "t": "stopped by a tracer (a debugger: process state t)",
}


class StoppedWatch:
    """Which running ranks have stayed stopped for :data:`STOPPED_GRACE_S`."""

    def __init__(
        self,
        pids: Mapping[int, int],
        started: float,
        state: Callable[[int], str | None] = process_state,
    ) -> None:
        self._pids = dict(pids)
        self._state = state
        #: When the next read is due (``time.monotonic()``): the caller may skip calling before.
        self.next_sample = started + SAMPLE_S
        self._stopped_since: dict[int, float] = {}
        self._how: dict[int, str] = {}

    def stopped(self, ranks: Sequence[int], now: float) -> dict[int, str]:
        """The ranks of ``ranks`` stopped for the grace, each with how (``STOPPED_STATES``);
        empty while none is. ``now`` is ``time.monotonic()``; reads ``/proc`` at most every
        :data:`SAMPLE_S`."""
        if now < self.next_sample:
            return {}
        self.next_sample = now + SAMPLE_S
        for rank in ranks:
            pid = self._pids.get(rank)
            state = self._state(pid) if pid is not None else None
            if state in STOPPED_STATES:
                self._stopped_since.setdefault(rank, now)
                self._how[rank] = STOPPED_STATES[state]
            else:
                self._stopped_since.pop(rank, None)
        return {
            rank: self._how[rank]
            for rank, since in self._stopped_since.items()
            if rank in ranks and now - since >= STOPPED_GRACE_S
        }

    def since(self, rank: int) -> float | None:
        """When ``rank`` was first seen stopped (``time.monotonic()``), if it is."""
        return self._stopped_since.get(rank)
