"""One test in flight on one group of ranks: the bounded wait loop and what it learned.

The controller sends the test to every rank (:meth:`Flight.start`), then :meth:`Flight.wait`
waits until each rank answered or is lost: a timeout (``--fsdp-timeout``), a rank that left
early while the others are stuck in a collective it never joins
(:mod:`pytest_fp32keep.runner.stuck` judges, from what the ranks say they are blocked in), a
rank that died, a rank stopped (SIGSTOP, a debugger: :mod:`pytest_fp32keep.runner.stopped`), or
torchrun gone.
:meth:`Flight.collect_faults` then turns what is known into one
:class:`~pytest_fp32keep.runner.reports.RankFault` per rank that did not finish.
"""

from __future__ import annotations

import contextlib
import enum
import math
import selectors
import signal
import time
from pathlib import Path
from typing import Any, Final

import pytest

from pytest_fp32keep.runner import oom, protocol, reports
from pytest_fp32keep.runner.launcher import RankExit, RankGroup
from pytest_fp32keep.runner.stopped import STOPPED_GRACE_S, StoppedWatch
from pytest_fp32keep.runner.stuck import (
    FAILURE_GRACE_S,
    PROGRESS_SAMPLE_S,
    CpuProgress,
    Departure,
    StuckRank,
    judge_blocked,
)
from pytest_fp32keep.runner.waits import Blocked

#: After one rank dies, how long torchrun gets to stop the others and report exit codes.
DEATH_GRACE_S: Final = 5.0
#: How often the wait loop wakes up without news (to look at torchrun and the clock).
POLL_S: Final = 0.1


class _Stop(enum.Enum):
    TIMEOUT = "timeout"
    AFTER_EARLY_EXIT = "after a rank left early"
    AFTER_DEATH = "after death"
    STOPPED = "a rank was stopped"
    INTERRUPTED = "interrupted"


def departure(data: dict[str, Any]) -> str | None:
    """How a rank leaves the test's normal path with this serialised phase report: ``failed``,
    ``xfailed`` or ``skipped``; ``None`` where the phase passed (an xpass included)."""
    outcome = data.get("outcome")
    if outcome == "passed":
        return None
    if outcome == "failed":
        return "failed"
    return "xfailed" if "wasxfail" in data else "skipped"


class Flight:
    """One test in flight on one group: the wait loop and what it learned."""

    def __init__(self, group: RankGroup, nodeid: str, config: pytest.Config) -> None:
        self.group = group
        self.nodeid = nodeid
        self.config = config
        self.outcomes = {rank: reports.RankOutcome(rank) for rank in range(group.spec.nproc)}
        self.ended_at: dict[int, float] = {}  # rank -> wall time its connection ended
        # Ranks that left the normal path (a failed, skipped or xfailed phase), in arrival order.
        self.left_early: dict[int, str] = {}
        self.stop: _Stop | None = None
        self.stop_detail = ""
        self.timeout = 0.0
        self.timeout_from = ""  # the timeout and where it was set (options.timeout_words)
        self.started = 0.0  # monotonic time the test was sent to the ranks
        self.waited = 0.0  # seconds from the send to the end of the wait (its wall time)
        self.group_broken = False  # a rank said its process group cannot serve another test
        self.departures: dict[int, Departure] = {}  # ranks that left early: when, how
        self.blocked: dict[int, Blocked] = {}  # what each running rank said it is blocked in
        self.stuck: dict[int, StuckRank] = {}  # the verdict, for ranks that could report
        self.busy_for = 0.0  # ranks judged by CPU time: how long they computed after one left
        self.stopped: dict[int, str] = {}  # ranks found stopped (SIGSTOP, ...): how
        self.oom_before: dict[Path, int] = {}  # the ranks' cgroup oom_kill counts at the start

    @property
    def broken(self) -> bool:
        """The group cannot take another test (a rank died, hung, broke its process group, or
        the test was cut short)."""
        return self.stop is not None or bool(self.ended_at) or self.group_broken

    def _waiting(self) -> list[int]:
        return [
            rank
            for rank, outcome in self.outcomes.items()
            if not outcome.finished and rank not in self.ended_at
        ]

    def start(
        self, next_nodeid: str | None, seed: int, timeout: float, timeout_from: str = ""
    ) -> None:
        """Send the test to every rank; its ``timeout`` counts from now; ``timeout_from`` says
        it and where it was set, for the report of a hang."""
        self.timeout = timeout
        self.timeout_from = timeout_from or f"{timeout:g} s"
        # Read before the test runs: a SIGKILL with a rise since is the OOM killer's.
        self.oom_before = oom.read_counts(set(self.group.oom_counters.values()))
        selector = self.group.selector()
        for rank in self.group.send_all(protocol.run(self.nodeid, next_nodeid, seed)):
            self.ended_at[rank] = time.time()
            with contextlib.suppress(KeyError):  # not registered: nothing to wait for
                selector.unregister(self.group.ranks[rank].channel)
        self.started = time.monotonic()

    def wait(self) -> None:
        """Wait, bounded by the timeout counted from :meth:`start`, until each rank answered
        or is lost."""
        timeout = self.timeout
        selector = self.group.selector()
        start = self.started
        failure_seen: float | None = None
        death_seen: float | None = start if self.ended_at else None
        pids = {rank: handle.pid for rank, handle in self.group.ranks.items()}
        progress = CpuProgress(pids)
        stopped = StoppedWatch(pids, start)
        launcher_checked = -math.inf
        try:
            while self._waiting():
                now = time.monotonic()
                if now >= start + timeout:
                    self.stop = _Stop.TIMEOUT
                    break
                if failure_seen is not None and self._peers_stuck(progress, failure_seen, now):
                    self.stop = _Stop.AFTER_EARLY_EXIT
                    break
                if death_seen is not None and now >= death_seen + DEATH_GRACE_S:
                    self.stop = _Stop.AFTER_DEATH
                    break
                if now >= stopped.next_sample:
                    self.stopped = stopped.stopped(self._waiting(), now)
                    if self.stopped:
                        self.stop = _Stop.STOPPED
                        break
                if now >= launcher_checked + POLL_S:  # a wait syscall: not at every message
                    launcher_checked = now
                    if not self.group.launcher_running():
                        # torchrun is gone; whatever the sockets still hold is read below,
                        # then every rank that did not answer counts as ended.
                        self._drain(selector)
                        for rank in self._waiting():
                            self.ended_at[rank] = time.time()
                        break
                limit = min(POLL_S, start + timeout - now)
                for key, _ in selector.select(max(limit, 0.0)):
                    rank = int(key.data)
                    if self._read(rank, key.fileobj, selector):  # type: ignore[arg-type]
                        failure_seen = (
                            failure_seen if failure_seen is not None else time.monotonic()
                        )
                    if rank in self.ended_at and death_seen is None:
                        death_seen = time.monotonic()
        except pytest.fail.Exception as exc:
            # An outside timeout (pytest-timeout's signal method) fired while the ranks ran:
            # turn it into this test's failure, with the ranks' stacks, instead of a crash.
            self.stop = _Stop.INTERRUPTED
            self.stop_detail = str(exc)
        finally:
            self.waited = time.monotonic() - start

    def _peers_stuck(self, progress: CpuProgress, failure_seen: float, now: float) -> bool:
        """Whether the ranks still running are stuck after one left (``stuck`` judges)."""
        running = self._waiting()
        handles = self.group.ranks
        if all(handles[rank].observes for rank in running if rank in handles):
            verdict = judge_blocked(running, self.blocked, self.departures, time.time())
            self.stuck = verdict or {}
            return verdict is not None
        busy_for = progress.stuck(running, failure_seen, now)
        if busy_for is None:
            return False
        self.busy_for = busy_for
        return True

    def _drain(self, selector: selectors.BaseSelector) -> None:
        for key, _ in selector.select(0):
            self._read(int(key.data), key.fileobj, selector)  # type: ignore[arg-type]

    def _read(self, rank: int, channel: protocol.Channel, selector: selectors.BaseSelector) -> bool:
        """Take in what ``rank`` sent; whether it reported a failure."""
        try:
            messages = channel.read_available()
        except (protocol.ConnectionClosed, OSError):
            self.ended_at[rank] = time.time()
            selector.unregister(channel)
            return False
        failed = False
        outcome = self.outcomes[rank]
        for message in messages:
            if message.get("nodeid") != self.nodeid:
                continue
            kind = message["type"]
            if kind == protocol.REPORT:
                data = message["report"]
                outcome.serialized.append(data)  # decoded after the wait: decode_reports()
                how = departure(data)
                if how is not None and rank not in self.left_early:
                    self._left(rank, how)
                    failed = True
            elif kind == protocol.WAITING:
                wait = message.get("wait")
                if wait is None:
                    self.blocked.pop(rank, None)
                else:
                    self.blocked[rank] = Blocked.from_message(wait)
            elif kind == protocol.DONE:
                outcome.finished = True
                outcome.notes += list(message.get("notes", []))
                outcome.warnings += list(message.get("warnings", []))
                self.group_broken = self.group_broken or bool(message.get("broken"))
                if not any(data.get("when") == "teardown" for data in outcome.serialized):
                    outcome.fault = reports.RankFault(
                        "internal",
                        "finished without a teardown report",
                        at=time.time(),
                    )
                elif problems := message.get("problems"):
                    outcome.fault = reports.RankFault(
                        "error", "\n".join(problems), summary=problems[0].split("\n")[0],
                        at=time.time(),
                    )  # fmt: skip
                self.blocked.pop(rank, None)
                if rank not in self.left_early:
                    # A peer still running may wait in a collective this rank never joins.
                    self._left(rank, "finished")
                    failed = True
            elif kind == protocol.MISSING:
                outcome.finished = True
                outcome.fault = reports.RankFault("missing", message["detail"], at=time.time())
        return failed

    def passed_everywhere(self) -> bool:
        """Whether every rank finished and passed setup, call and teardown, with nothing to add
        (no fault, no note) and its process group fit for the next test: read from the phase
        reports as they arrived, before :meth:`decode_reports`."""
        return not self.broken and all(
            outcome.finished
            and outcome.fault is None
            and not outcome.notes
            and sorted(data.get("when", "") for data in outcome.serialized)
            == ["call", "setup", "teardown"]
            and not any(departure(data) or "wasxfail" in data for data in outcome.serialized)
            for outcome in self.outcomes.values()
        )

    def decode_reports(self) -> None:
        """Turn every rank's serialised phase reports into pytest's reports (pytest's own
        ``pytest_report_from_serializable``, so other plugins' report fields come back too)."""
        hook = self.config.hook
        for outcome in self.outcomes.values():
            outcome.reports += [
                hook.pytest_report_from_serializable(config=self.config, data=data)
                for data in outcome.serialized
            ]
            outcome.serialized.clear()

    def _left(self, rank: int, how: str) -> None:
        self.left_early[rank] = how
        self.departures[rank] = Departure(time.time(), how)

    def collect_faults(self) -> None:
        """After a broken flight: learn how ranks ended, dump the stuck ones, kill the group."""
        self.decode_reports()
        group = self.group
        if self.stop is None and self.ended_at:
            # Only deaths: torchrun stops the other ranks and prints who failed how.
            group.wait_launcher_exit(DEATH_GRACE_S)
        stuck = self._waiting()
        # A stopped rank cannot write its stack: asking it would only wait out the dump's grace.
        dump = [rank for rank in stuck if rank not in self.stopped]
        stacks = group.dump_stacks(dump) if dump and group.launcher_running() else {}
        group.kill()
        exits = group.rank_exits()
        for rank, ended in self.ended_at.items():
            if not self.outcomes[rank].finished:
                self.outcomes[rank].fault = self._death_fault(rank, ended, exits.get(rank))
        now = time.time()
        for rank in stuck:
            self.outcomes[rank].fault = self._stuck_fault(rank, stacks.get(rank, ""), now)

    def _death_fault(
        self, rank: int, ended: float, exit_info: RankExit | None
    ) -> reports.RankFault:
        """Why ``rank``'s connection ended before it finished, as torchrun tells it."""
        summary = "a rank died"
        if exit_info is None:
            detail = (
                "ended without a result (torchrun reported no failure for it: "
                "it exited with code 0, or was stopped before torchrun could tell)"
            )
            consequence = False
        elif exit_info.terminated_by_torchrun:
            detail = "was stopped by torchrun (SIGTERM) after another rank failed"
            consequence = True
        else:
            detail = f"{exit_info.describe()} while running the test"
            consequence = False
            killer = (
                oom.oom_killed(self.group.oom_counters.get(rank), self.oom_before)
                if exit_info.exitcode == -signal.SIGKILL
                else None
            )
            if killer is not None:
                detail += f", {killer}"
                summary = "a rank was killed by the kernel's out-of-memory killer"
        return reports.RankFault(
            "died",
            detail,
            summary=summary,
            at=ended,
            consequence=consequence,
            log_tail="" if consequence else self.group.rank_log_tail(rank, self.nodeid),
        )

    def _stuck_fault(self, rank: int, stack: str, now: float) -> reports.RankFault:
        """Why a rank that was still running was killed (timeout, stuck, interrupted)."""
        left = "; ".join(f"rank {r} {how}" for r, how in self.left_early.items()) or "?"
        dead = ", ".join(str(r) for r in self.ended_at if not self.outcomes[r].finished) or "?"
        if self.stop == _Stop.TIMEOUT:
            kind = "timeout"
            summary = f"still running after {self.timeout_from}"
            detail = (
                f"was still running after {self.timeout_from}; "
                "killed (the next test gets fresh ranks)"
            )
        elif self.stop == _Stop.AFTER_EARLY_EXIT:
            kind = "stuck"
            summary = f"stuck after {left}"
            detail = self._stuck_detail(rank, left)
        elif self.stop == _Stop.STOPPED:
            return self._stopped_fault(rank, stack, now)
        elif self.stop == _Stop.AFTER_DEATH:
            kind = "stuck"
            summary = "stuck after another rank died"
            detail = f"did not finish within {DEATH_GRACE_S:g} s after rank(s) {dead} died; killed"
        else:
            kind = "interrupted"
            summary = f"interrupted: {self.stop_detail}"
            detail = f"was killed because the test was interrupted: {self.stop_detail}"
        return reports.RankFault(
            kind, detail, summary=summary, at=now, consequence=True, stack=stack
        )

    def _stopped_fault(self, rank: int, stack: str, now: float) -> reports.RankFault:
        """A rank found stopped is the cause; the ranks killed with it are its consequence."""
        how = self.stopped.get(rank)
        if how is not None:
            detail = (
                f"was {how} for {STOPPED_GRACE_S:g} s while running the test; killed "
                "(a stopped rank never finishes, and its peers wait for it in their next "
                "collective; the next test gets fresh ranks)"
            )
            return reports.RankFault(
                "stopped", detail, summary=f"a rank was {how}", at=now - STOPPED_GRACE_S
            )
        gone = reports.ranks_text(self.stopped)
        return reports.RankFault(
            "stuck",
            f"was killed with {gone}, which was stopped (it could not finish without it)",
            summary=f"stuck while {gone} was stopped",
            at=now,
            consequence=True,
            stack=stack,
        )

    def _stuck_detail(self, rank: int, left: str) -> str:
        """Why a rank still running after ``left`` was killed."""
        verdict = self.stuck.get(rank)
        if verdict is not None and not verdict.blocked:
            return f"was killed after {left}: {verdict.reason}"
        if verdict is not None:
            first = (
                f" (it ran its own code for {verdict.own_code_for:.1f} s first)"
                if verdict.own_code_for >= PROGRESS_SAMPLE_S
                else ""
            )
            within = FAILURE_GRACE_S + verdict.own_code_for
            return (
                f"did not finish within {within:.0f} s after {left}{first}: "
                f"{verdict.reason}; killed"
            )
        busy = (
            f" (ranks kept computing for {self.busy_for:.1f} s, then made no progress "
            f"for {FAILURE_GRACE_S:g} s)"
            if self.busy_for >= PROGRESS_SAMPLE_S
            else ""
        )
        return (
            f"did not finish within {FAILURE_GRACE_S + self.busy_for:.0f} s after {left}"
            f"{busy} (it used no CPU: typically waiting in a collective the other rank never "
            "reached; this rank could not say what it waited in); killed"
        )
