"""Which rank of a launched world died: each rank's last step and its end, in the launcher's store.

When a rank dies (``os._exit``, a segfault, the OOM killer), the other ranks learn it only
indirectly: a collective fails with a closed connection, or the launcher stops them with SIGTERM.
Neither says which rank it was. So every rank writes, to the key-value store the process group
was initialised from (torchrun's agent store, or the one rank 0 hosts under srun: nothing new
listens), what it is doing (``"the call of test_x.py::test_y"``) before each step, and, when it
leaves the session through the plugin (a failed agreement, the launcher's SIGTERM), that it
ended and why. A rank that died leaves no such mark: once rank 0 is told to stop, it waits a
bounded grace for every rank's end and names those that never answered, with their last step.
Its exit status or signal is known only to the launcher, whose log rank 0's message points to.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Final

#: How long rank 0 waits for the other ranks to say that they ended, once it must end itself.
GRACE_S: Final = 5.0
_PREFIX: Final = "fp32keep-spmd-roll-call"
_POLL_S: Final = 0.1


class RollCall:
    """One rank's marks in the store, and, on rank 0, the names of the ranks that left none."""

    def __init__(self, rank: int, world_size: int, store: Any = None) -> None:
        if store is None:
            from pytest_fp32keep.runner.c10d_groups import default_store

            store = default_store()
        from torch.distributed.distributed_c10d import PrefixStore  # public, re-exported

        # A restart of the world by the launcher reuses its store: keys of an earlier attempt
        # must not answer for this one.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = PrefixStore(f"{_PREFIX}/{attempt}", store)
        self._rank = rank
        self._world_size = world_size

    def doing(self, what: str) -> None:
        """This rank's current step, named for the report of its death."""
        self._set(f"doing/{self._rank}", what)

    def ended(self, why: str, *, cause: bool = False) -> None:
        """This rank leaves the session through the plugin (it did not die); with ``cause``,
        ``why`` is the run's cause, which rank 0 names (:meth:`causes`)."""
        if cause:
            self._set(f"cause/{self._rank}", why)
        self._set(f"ended/{self._rank}", why)

    def causes(self) -> list[str]:
        """``"rank 1: WHY"`` for every other rank that ended the run with a cause, in rank
        order."""
        others = [rank for rank in range(self._world_size) if rank != self._rank]
        return [f"rank {rank}: {why}" for rank in others if (why := self._get(f"cause/{rank}"))]

    def silent(self, grace_s: float = GRACE_S) -> dict[int, str]:
        """The ranks that did not say they ended within ``grace_s``, each with its last step
        (``""`` if it never wrote one). Returns early once every rank has answered."""
        waiting = set(range(self._world_size)) - {self._rank}
        deadline = time.monotonic() + grace_s
        while waiting:
            waiting = {rank for rank in waiting if not self._has(f"ended/{rank}")}
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        return {rank: self._get(f"doing/{rank}") for rank in sorted(waiting)}

    def _set(self, key: str, value: str) -> None:
        with contextlib.suppress(Exception):  # the store's host is gone: nobody reads it
            self._store.set(key, value)

    def _has(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:
            return False

    def _get(self, key: str) -> str:
        if not self._has(key):
            return ""
        try:
            return bytes(self._store.get(key)).decode(errors="replace")
        except Exception:
            return ""


def describe(silent: dict[int, str], launcher: str, grace_s: float = GRACE_S) -> str:
    """``"rank 2 stopped answering during the call of T: it died (its exit status is in
    torchrun's log)"``, one clause per silent rank; ``""`` when every rank answered."""
    if not silent:
        return ""
    clauses = [
        f"rank {rank} stopped answering" + (f" during {doing}" if doing else "")
        for rank, doing in silent.items()
    ]
    died = "it" if len(silent) == 1 else "they"
    return (
        "; ".join(clauses)
        + f" ({died} did not end through the plugin within {grace_s:g} s: died, e.g. killed or "
        f"os._exit; the exit status or signal is in {launcher}'s log)"
    )
