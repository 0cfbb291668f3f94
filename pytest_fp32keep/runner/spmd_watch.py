"""Hang detection under an external launcher: every rank's stack, on rank 0, then the end.

In the local mode the controller watches the ranks from outside; in a launched world there is no
outside, and a rank stuck in a collective can be freed only by killing it, which is the
launcher's business. So each rank arms a timer per test (its marker's ``timeout``, else
``--fsdp-timeout``). Every rank runs the same tests in step, so when one hangs no rank can finish
the test's last agreement and every rank's timer fires: each writes what it was doing and its
main thread's Python stack to the launcher's store (the key-value store the process group was
initialised from: no new listener), rank 0 waits a bounded grace for the others', writes them all
to the terminal, merged where identical, and exits; the launcher then stops the rest.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any, Final

from pytest_fp32keep.runner.c10d_groups import default_store

#: How long rank 0 waits for the other ranks' stacks once its own timer fired.
GRACE_S: Final = 20.0
#: Exit status of a rank whose test did not finish in time (pytest's "interrupted").
EXIT_HUNG: Final = 2
_PREFIX: Final = "fp32keep-spmd-hang"
#: Frames of these packages sit above a test's own and are cut from the report.
_FRAMEWORK: Final = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}")


class HangWatch:
    """One rank's timer over the test it runs; see the module docstring."""

    def __init__(self, rank: int, world_size: int, launcher: str, terminal_fd: int) -> None:
        from torch.distributed.distributed_c10d import PrefixStore

        # The store the default group was initialised from (torchrun's agent store, or the one
        # rank 0 hosts under srun): the only channel a thread can use while collectives hang.
        self._store = PrefixStore(_PREFIX, default_store())
        self._rank = rank
        self._world_size = world_size
        self._launcher = launcher
        self._terminal_fd = terminal_fd
        self._timer: threading.Timer | None = None
        self._count = 0
        self._doing = ""

    def begin(self, nodeid: str, timeout_s: float, timeout_from: str = "") -> None:
        """Arm the timer for ``nodeid``; the same test has the same number on every rank.
        ``timeout_from`` says the timeout and where it was set (``options.timeout_words``)."""
        self._count += 1
        self._doing = "starting"
        wording = timeout_from or f"{timeout_s:g} s"
        self._timer = threading.Timer(timeout_s, self._expired, (self._count, nodeid, wording))
        self._timer.daemon = True
        self._timer.start()

    def doing(self, what: str) -> None:
        """What this rank does now, for the report ("in call", "waiting for the others ...")."""
        self._doing = what

    def end(self) -> None:
        """The test finished on every rank (its last agreement is done): disarm."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, count: int, nodeid: str, timeout_from: str) -> None:
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        stack = _test_frames(main) if main is not None else "(no stack)\n"
        entry = json.dumps({"doing": self._doing, "stack": stack})
        try:
            self._store.set(f"{count}/{self._rank}", entry)
        except Exception:  # the store's host is gone: nothing to tell, nobody to tell it to
            os._exit(EXIT_HUNG)
        if self._rank != 0:
            time.sleep(GRACE_S + 10)  # the launcher stops this rank once rank 0 has exited
            os._exit(EXIT_HUNG)
        accounts = self._collect(count)
        text = render(nodeid, timeout_from, accounts, self._world_size, self._launcher)
        os.write(self._terminal_fd, text.encode(errors="replace"))
        os._exit(EXIT_HUNG)

    def _collect(self, count: int) -> dict[int, dict[str, Any]]:
        """Every rank's account that arrives within the grace, by rank."""
        keys = {rank: f"{count}/{rank}" for rank in range(self._world_size)}
        accounts: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + GRACE_S
        while len(accounts) < self._world_size and time.monotonic() < deadline:
            for rank, key in keys.items():
                if rank not in accounts and self._store.check([key]):
                    accounts[rank] = json.loads(self._store.get(key))
            time.sleep(0.2)
        return accounts


def render(
    nodeid: str,
    timeout_from: str,
    accounts: dict[int, dict[str, Any]],
    world_size: int,
    launcher: str,
) -> str:
    """The report rank 0 writes: the test and its timeout as the local mode words it ("still
    running after 8 s (@pytest.mark.fsdp2(timeout=8))"), then each group of ranks with the same
    account."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(accounts):
        account = accounts[rank]
        groups.setdefault((account["doing"], account["stack"]), []).append(rank)
    lines = [
        "",
        f"fsdp2: {nodeid} was still running after {timeout_from} on the {world_size} ranks "
        f"{launcher} launched; the run ends here (a rank stuck in a collective can only be "
        "killed, which is the launcher's to do). Each rank's main thread:",
    ]
    for (doing, stack), ranks in groups.items():
        lines += [f"---- {_label(ranks)}: {doing} ----", stack.rstrip()]
    silent = sorted(set(range(world_size)) - set(accounts))
    if silent:
        lines.append(f"---- {_label(silent)}: no account within {GRACE_S:g} s ----")
    return "\n".join(lines) + "\n"


def _test_frames(frame: FrameType) -> str:
    """The stack from the test's own frames down: pytest's and pluggy's, above, say nothing."""
    frames = traceback.extract_stack(frame)
    framework = [i for i, f in enumerate(frames) if any(part in f.filename for part in _FRAMEWORK)]
    start = framework[-1] + 1 if framework and framework[-1] + 1 < len(frames) else 0
    return "".join(traceback.format_list(frames[start:]))


def _label(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
