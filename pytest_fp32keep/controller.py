"""The controller: decides where each marked test runs, dispatches it, reports it.

It takes over ``pytest_runtest_protocol`` for marked items, the way pytest-xdist does for its
workers: it emits ``pytest_runtest_logstart``, one ``pytest_runtest_logreport`` per phase
built from the ranks' reports, and ``pytest_runtest_logfinish``. Unmarked items are left to
pytest.

Per marked test, in order, and without starting any rank unless the test will run:

1. the marker's arguments are validated (a bad one is an error of that test);
2. ``skip``/``skipif`` marks and ``xfail(run=False)`` are decided here, in the parent;
3. the backend is resolved (``auto``: nccl with one CUDA device per rank if there are enough,
   else gloo); a test that cannot run here (nccl without the devices) is skipped with a reason;
4. the test goes to the group of ranks for its (nproc, backend), started on first use and kept
   alive; ``isolated=True`` gets a group of its own, torn down after it;
5. every rank runs it; the controller waits, bounded by ``--fsdp-timeout``, for the ranks'
   reports. When one rank fails and the others do not answer within ``FAILURE_GRACE_S`` they
   are taken to be stuck in a collective: their stacks are dumped and the group is killed.
   A rank that dies, or a timeout, also ends the group; the next test gets fresh ranks.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import selectors
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import Final

import pytest
from _pytest.skipping import evaluate_skip_marks, evaluate_xfail_marks

from pytest_fp32keep import options, protocol, reports
from pytest_fp32keep.devices import count_cuda_devices
from pytest_fp32keep.launcher import LaunchError, LaunchSpec, RankGroup, shutdown_all

#: After one rank left the test early (failed, skipped, xfailed), how long the others get to
#: answer before they count as stuck (typically in a collective the first one never reached).
FAILURE_GRACE_S: Final = 3.0
#: After one rank dies, how long torchrun gets to stop the others and report exit codes.
DEATH_GRACE_S: Final = 5.0
#: Ranks import torch and collect their files before the first test; never allow less.
MIN_READY_TIMEOUT_S: Final = 120.0
#: The process-group timeout exceeds the test timeout: the watchdog, not gloo/nccl, decides.
PG_TIMEOUT_MARGIN_S: Final = 60.0
#: At the end of the session, how long the ranks get to tear down their session fixtures.
SHUTDOWN_TIMEOUT_S: Final = 20.0
#: How often the dispatch loop wakes up without news (to look at torchrun and the clock).
POLL_S: Final = 0.1
#: A group whose start failed this many times in a row is not tried again this session.
MAX_LAUNCH_ATTEMPTS: Final = 2


@dataclasses.dataclass(frozen=True)
class GroupKey:
    """Marked tests with the same key share one group of ranks."""

    nproc: int
    backend: str


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one marked test runs, or why it does not."""

    settings: options.ItemSettings | None = None
    key: GroupKey | None = None
    error: str | None = None  # invalid marker: an error of the test
    skip: str | None = None  # cannot run here: a skip decided in the parent


class _Stop(enum.Enum):
    TIMEOUT = "timeout"
    AFTER_EARLY_EXIT = "after a rank left early"
    AFTER_DEATH = "after death"
    INTERRUPTED = "interrupted"


def seed_for(nodeid: str) -> int:
    """The seed every rank uses for this test: stable across runs and ranks."""
    return zlib.crc32(nodeid.encode("utf-8")) & 0x7FFFFFFF


class Fsdp2Controller:
    """The parent-side plugin object; registered by ``plugin.py`` outside the ranks."""

    def __init__(self, config: pytest.Config, settings: options.SessionSettings) -> None:
        self._config = config
        self._settings = settings
        self._items: list[pytest.Item] = []
        self._placements: dict[str, Placement] = {}
        self._planned = False
        self._next_in_group: dict[str, str] = {}
        self._groups: dict[GroupKey, RankGroup] = {}
        self._live: list[RankGroup] = []
        self._launch_failures: dict[GroupKey, tuple[int, str]] = {}
        self._cuda_devices: int | None = None
        self._launches = 0
        self._run_root: Path | None = None
        atexit.register(self.kill_all)

    # --- hooks, in lifecycle order ---------------------------------------------------------

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Remember the run order: it tells which files each group collects and, for each
        test, which test of its group comes next (so module fixtures survive between them)."""
        self._items = list(session.items)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> bool | None:
        """Run a marked test in its ranks and log its merged reports; leave others to pytest."""
        if not options.is_marked(item):
            return None
        if self._config.option.setuponly or self._config.option.setupplan:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self._reports_for(item, nextitem):
            ihook.pytest_runtest_logreport(report=report)
        self._teardown_parent_collectors(item, nextitem)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    @staticmethod
    def _teardown_parent_collectors(item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Keep the pytest process's setup stack in step, as pytest's own teardown would.

        Marked tests never set anything up here, but the unmarked tests before them may have
        (a package or module fixture): those collectors must be finalised when the run leaves
        them, or the next unmarked test finds the stack out of step ("previous item was not
        torn down properly"). A finaliser that raises is reported as this test's teardown error.
        """
        setupstate = getattr(item.session, "_setupstate", None)
        if setupstate is None:  # pragma: no cover - a pytest without the private attribute
            return
        call = pytest.CallInfo.from_call(
            lambda: setupstate.teardown_exact(nextitem), when="teardown"
        )
        if call.excinfo is not None:
            report = pytest.TestReport.from_item_and_call(item, call)
            item.ihook.pytest_runtest_logreport(report=report)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """With ``-v``: how many groups of ranks this session started."""
        if self._launches and self._config.get_verbosity() > 0:
            terminalreporter.write_line(f"fsdp2: started {self._launches} group(s) of ranks")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Let the ranks finish their sessions (teardown), or kill them on an interrupt."""
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            self.kill_all()
        else:
            self.close()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Whatever happened before, no process of ours outlives the session."""
        self.kill_all()
        atexit.unregister(self.kill_all)

    # --- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Ask every live group to exit, wait (bounded), kill what is left."""
        # The groups stay listed until they are gone: if this is interrupted (a second
        # Ctrl-C), pytest_unconfigure still finds and kills them.
        shutdown_all(list(self._live), SHUTDOWN_TIMEOUT_S)
        self._live.clear()
        self._groups.clear()

    def kill_all(self) -> None:
        """SIGKILL every group at once (Ctrl-C, interpreter exit)."""
        for group in list(self._live):
            group.kill()
        self._live.clear()
        self._groups.clear()

    # --- one marked test -------------------------------------------------------------------

    def _reports_for(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> list[pytest.TestReport]:
        info = reports.ItemInfo.from_item(item)
        try:
            return self._decide_and_run(item, nextitem, info)
        except pytest.fail.Exception as exc:
            # A bad skipif condition, or an outside timeout while starting ranks.
            return reports.error_reports(info, f"fsdp2: {exc}")
        except LaunchError as exc:
            return reports.error_reports(info, str(exc))
        except Exception:
            # A bug of the plugin must cost one test, not the session (an exception out of
            # this hook would be an INTERNALERROR that ends pytest).
            return reports.error_reports(
                info, "fsdp2: internal error of pytest-fp32keep:\n" + traceback.format_exc()
            )

    def _decide_and_run(
        self, item: pytest.Item, nextitem: pytest.Item | None, info: reports.ItemInfo
    ) -> list[pytest.TestReport]:
        placement = self._placement(item)
        if placement.error is not None:
            return reports.error_reports(info, placement.error)
        skip = evaluate_skip_marks(item)
        if skip is not None:
            return reports.skipped_reports(info, skip.reason)
        xfail = evaluate_xfail_marks(item)
        if xfail is not None and not xfail.run and not self._config.option.runxfail:
            return reports.xfail_not_run_reports(info, xfail.reason)
        if placement.skip is not None:
            return reports.skipped_reports(info, placement.skip)
        assert placement.settings is not None and placement.key is not None
        settings, key = placement.settings, placement.key

        if settings.isolated:
            group = self._launch(key, (str(item.path),), settings)
            try:
                outcomes, _ = self._dispatch(group, item, None, settings.timeout)
            finally:
                if group in self._live:
                    self._live.remove(group)
                shutdown_all([group], SHUTDOWN_TIMEOUT_S)
            return reports.merge(info, outcomes)

        group = self._shared_group(key, settings)
        outcomes, keep = self._dispatch(
            group, item, self._next_nodeid(item, nextitem), settings.timeout
        )
        if not keep:
            self._discard(key)
        elif self._is_last_of_group(item):
            # Nothing else will run in these ranks: let them end their session now (freeing
            # their memory) rather than idle until the end of ours. Reaped at session end.
            group.request_exit()
            self._groups.pop(key, None)
        return reports.merge(info, outcomes)

    def _is_last_of_group(self, item: pytest.Item) -> bool:
        """Whether ``item`` is the last test of its group in the run order (unknown: no)."""
        if hasattr(self._config, "workerinput"):
            return False  # under xdist the worker's order is decided as it goes
        return item.nodeid in self._placements and item.nodeid not in self._next_in_group

    # --- placement -------------------------------------------------------------------------

    def _placement(self, item: pytest.Item) -> Placement:
        if not self._planned:
            self._plan()
            self._planned = True
        if item.nodeid not in self._placements:  # not seen at collection (another plugin)
            self._placements[item.nodeid] = self._place(item)
        return self._placements[item.nodeid]

    def _place(self, item: pytest.Item) -> Placement:
        try:
            settings = options.item_settings(item, self._settings)
        except options.MarkerError as exc:
            return Placement(error=str(exc))
        if settings.backend == "gloo":
            return Placement(settings, GroupKey(settings.nproc, "gloo"))
        devices = self._count_cuda_devices()
        if devices >= settings.nproc:
            return Placement(settings, GroupKey(settings.nproc, "nccl"))
        if settings.backend == "nccl":
            return Placement(
                settings,
                skip=(
                    f"fsdp2: backend nccl needs {settings.nproc} CUDA devices (one per rank), "
                    f"{devices} visible here; run with --fsdp-backend=gloo (or auto), or ask "
                    f"for at most {devices} ranks"
                ),
            )
        return Placement(settings, GroupKey(settings.nproc, "gloo"))

    def _plan(self) -> None:
        """Place every marked test of the session once; link each to its group's next test."""
        last: dict[GroupKey, str] = {}
        for item in self._items:
            if not options.is_marked(item):
                continue
            placement = self._place(item)
            self._placements[item.nodeid] = placement
            if placement.key is None or placement.settings is None or placement.settings.isolated:
                continue
            if placement.key in last:
                self._next_in_group[last[placement.key]] = item.nodeid
            last[placement.key] = item.nodeid

    def _count_cuda_devices(self) -> int:
        if self._cuda_devices is None:
            self._cuda_devices = count_cuda_devices()
        return self._cuda_devices

    def _next_nodeid(self, item: pytest.Item, nextitem: pytest.Item | None) -> str | None:
        """The test this group's ranks will run next, as far as the parent can know.

        pytest's own ``nextitem`` is exact when it belongs to the same group. Otherwise the
        next test of the group in collection order is the parent's run order, except under
        xdist, where the worker's order is unknown: then nothing is kept (always correct).
        """
        if nextitem is None:
            return None
        placement = self._placements.get(nextitem.nodeid)
        current = self._placements.get(item.nodeid)
        same_group = placement is not None and current is not None and placement.key == current.key
        if same_group and placement and placement.settings and not placement.settings.isolated:
            return nextitem.nodeid
        if hasattr(self._config, "workerinput"):
            return None
        return self._next_in_group.get(item.nodeid)

    # --- groups ----------------------------------------------------------------------------

    def _shared_group(self, key: GroupKey, settings: options.ItemSettings) -> RankGroup:
        group = self._groups.get(key)
        if group is not None and group.usable():
            return group
        if group is not None:
            self._discard(key)
        files = sorted(
            {
                str(item.path)
                for item in self._items
                if (p := self._placements.get(item.nodeid))
                and p.key == key
                and p.settings is not None
                and not p.settings.isolated
            }
        )
        group = self._launch(key, tuple(files), settings)
        self._groups[key] = group
        return group

    def _discard(self, key: GroupKey) -> None:
        group = self._groups.pop(key, None)
        if group is not None:
            if group in self._live:
                self._live.remove(group)
            group.kill()

    def _launch(
        self, key: GroupKey, files: tuple[str, ...], settings: options.ItemSettings
    ) -> RankGroup:
        failures, message = self._launch_failures.get(key, (0, ""))
        if failures >= MAX_LAUNCH_ATTEMPTS:
            raise LaunchError(
                f"fsdp2: not starting {key.nproc} {key.backend} ranks again: the last "
                f"{failures} attempts failed. The last one said:\n{message}"
            )
        self._launches += 1
        spec = LaunchSpec(
            nproc=key.nproc,
            backend=key.backend,
            files=files,
            pytest_args=tuple(options.rank_pytest_args(self._config)),
            cwd=self._config.invocation_params.dir,
            run_dir=Path(
                tempfile.mkdtemp(
                    prefix=f"launch{self._launches}-{key.nproc}x{key.backend}-",
                    dir=self._run_root_dir(),
                )
            ),
            pg_timeout=settings.timeout + PG_TIMEOUT_MARGIN_S,
            ready_timeout=max(settings.timeout, MIN_READY_TIMEOUT_S),
        )
        try:
            group = RankGroup.start(spec)
        except LaunchError as exc:
            self._launch_failures[key] = (failures + 1, str(exc))
            raise
        self._launch_failures.pop(key, None)
        self._live.append(group)
        return group

    def _run_root_dir(self) -> Path:
        """Logs and stack dumps live in the session's basetemp, beside ``tmp_path`` dirs."""
        if self._run_root is None:
            factory = getattr(self._config, "_tmp_path_factory", None)
            base = (
                Path(factory.getbasetemp()) if factory is not None else Path(tempfile.gettempdir())
            )
            self._run_root = base / "fsdp2"
            self._run_root.mkdir(parents=True, exist_ok=True)
        return self._run_root

    # --- dispatch --------------------------------------------------------------------------

    def _dispatch(
        self, group: RankGroup, item: pytest.Item, next_nodeid: str | None, timeout: float
    ) -> tuple[list[reports.RankOutcome], bool]:
        """Run one test on every rank of ``group``; return the outcomes and whether the group
        can be kept for the next test."""
        flight = _Flight(group, item.nodeid, self._config)
        try:
            flight.run(next_nodeid, seed_for(item.nodeid), timeout)
        except BaseException:
            # Ctrl-C (or anything unforeseen) while ranks run: never leave them behind.
            self._discard_group(group)
            raise
        if flight.broken:
            flight.collect_faults()
            self._discard_group(group)
        return [flight.outcomes[r] for r in sorted(flight.outcomes)], not flight.broken

    def _discard_group(self, group: RankGroup) -> None:
        for key, known in list(self._groups.items()):
            if known is group:
                del self._groups[key]
        if group in self._live:
            self._live.remove(group)
        group.kill()


class _Flight:
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

    @property
    def broken(self) -> bool:
        """The group cannot take another test (a rank died, hung, or the test was cut short)."""
        return self.stop is not None or bool(self.ended_at)

    def _waiting(self) -> list[int]:
        return [
            rank
            for rank, outcome in self.outcomes.items()
            if not outcome.finished and rank not in self.ended_at
        ]

    def run(self, next_nodeid: str | None, seed: int, timeout: float) -> None:
        """Send the test to every rank and wait, bounded, until each answered or is lost."""
        self.timeout = timeout
        for rank in self.group.send_all(protocol.run(self.nodeid, next_nodeid, seed)):
            self.ended_at[rank] = time.time()
        selector = selectors.DefaultSelector()
        for rank, handle in self.group.ranks.items():
            if rank not in self.ended_at:
                selector.register(handle.channel, selectors.EVENT_READ, rank)
        start = time.monotonic()
        failure_seen: float | None = None
        death_seen: float | None = start if self.ended_at else None
        try:
            while self._waiting():
                now = time.monotonic()
                if now >= start + timeout:
                    self.stop = _Stop.TIMEOUT
                    break
                if failure_seen is not None and now >= failure_seen + FAILURE_GRACE_S:
                    self.stop = _Stop.AFTER_EARLY_EXIT
                    break
                if death_seen is not None and now >= death_seen + DEATH_GRACE_S:
                    self.stop = _Stop.AFTER_DEATH
                    break
                if not self.group.launcher_running():
                    # torchrun is gone; whatever the sockets still hold is read below, then
                    # every rank that did not answer counts as ended.
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
            selector.close()

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
                report = self.config.hook.pytest_report_from_serializable(
                    config=self.config, data=message["report"]
                )
                outcome.reports.append(report)
                if not report.passed and rank not in self.left_early:
                    self.left_early[rank] = (
                        "failed"
                        if report.failed
                        else "xfailed"
                        if hasattr(report, "wasxfail")
                        else "skipped"
                    )
                    failed = True
            elif kind == protocol.DONE:
                outcome.finished = True
                outcome.notes += list(message.get("notes", []))
                if outcome.phase("teardown") is None:
                    outcome.fault = reports.RankFault(
                        "internal",
                        "finished without a teardown report",
                        at=time.time(),
                    )
            elif kind == protocol.MISSING:
                outcome.finished = True
                outcome.fault = reports.RankFault("missing", message["detail"], at=time.time())
        return failed

    def collect_faults(self) -> None:
        """After a broken flight: learn how ranks ended, dump the stuck ones, kill the group."""
        group = self.group
        if self.stop is None:
            # Only deaths: torchrun stops the other ranks and prints who failed how.
            group.wait_launcher_exit(DEATH_GRACE_S)
        stuck = self._waiting()
        stacks = group.dump_stacks(stuck) if stuck and group.launcher_running() else {}
        group.kill()
        exits = group.rank_exits()
        now = time.time()
        for rank, ended in self.ended_at.items():
            outcome = self.outcomes[rank]
            if outcome.finished:
                continue
            exit_info = exits.get(rank)
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
            outcome.fault = reports.RankFault(
                "died",
                detail,
                summary="a rank died",
                at=ended,
                consequence=consequence,
                log_tail="" if consequence else group.rank_log_tail(rank, self.nodeid),
            )
        left = "; ".join(f"rank {r} {how}" for r, how in self.left_early.items()) or "?"
        dead = ", ".join(str(r) for r in self.ended_at if not self.outcomes[r].finished) or "?"
        for rank in stuck:
            if self.stop == _Stop.TIMEOUT:
                kind = "timeout"
                summary = f"still running after --fsdp-timeout={self.timeout:g} s"
                detail = (
                    f"was still running after --fsdp-timeout={self.timeout:g} s; "
                    "killed (the next test gets fresh ranks)"
                )
            elif self.stop == _Stop.AFTER_EARLY_EXIT:
                kind = "stuck"
                summary = f"stuck after {left}"
                detail = (
                    f"did not finish within {FAILURE_GRACE_S:g} s after {left} (typically "
                    "waiting in a collective the other rank never reached); killed"
                )
            elif self.stop == _Stop.AFTER_DEATH:
                kind = "stuck"
                summary = "stuck after another rank died"
                detail = (
                    f"did not finish within {DEATH_GRACE_S:g} s after rank(s) {dead} died; killed"
                )
            else:
                kind = "interrupted"
                summary = f"interrupted: {self.stop_detail}"
                detail = f"was killed because the test was interrupted: {self.stop_detail}"
            self.outcomes[rank].fault = reports.RankFault(
                kind, detail, summary=summary, at=now, consequence=True, stack=stacks.get(rank, "")
            )
