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
   reports (:class:`~pytest_fp32keep.runner.flight.Flight`). When one rank fails and the others
   do not answer within a grace they are taken to be stuck in a collective: their stacks are
   dumped and the group is killed. A rank that dies, or a timeout, also ends the group; the
   next test gets fresh ranks.

When a test passed and the next one would run in the same ranks regardless, step 5 of the next
test starts before this one is decoded or logged (:mod:`pytest_fp32keep.runner.predispatch`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import tempfile
import time
import traceback
import warnings
import zlib
from pathlib import Path
from typing import Final

import pytest
from _pytest.skipping import evaluate_skip_marks, evaluate_xfail_marks

from pytest_fp32keep.runner import durations, options, predispatch, reports
from pytest_fp32keep.runner.devices import count_cuda_devices, nccl_shortfall
from pytest_fp32keep.runner.flight import Flight
from pytest_fp32keep.runner.launcher import LaunchError, LaunchSpec, RankGroup, shutdown_all
from pytest_fp32keep.runner.rank_warnings import relay_warnings
from pytest_fp32keep.runner.run_root import RunRoot

#: Ranks import torch and collect their files before the first test; never allow less.
MIN_READY_TIMEOUT_S: Final = 120.0
#: The process-group timeout exceeds the test timeout: the watchdog, not gloo/nccl, decides.
PG_TIMEOUT_MARGIN_S: Final = 60.0
#: At the end of the session, how long the ranks get to tear down their session fixtures.
SHUTDOWN_TIMEOUT_S: Final = 20.0
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
        self._following: dict[str, str | None] = {}  # node id -> the item after it in the run
        self._pending: predispatch.Predispatched | None = None
        self._groups: dict[GroupKey, RankGroup] = {}
        self._live: list[RankGroup] = []
        self._launch_failures: dict[GroupKey, tuple[int, str]] = {}
        self._cuda_devices: int | None = None
        self._launches = 0
        self._clock = durations.PhaseClock()  # start-up and wall time of the test reported
        self._run_root = RunRoot(config)
        atexit.register(self.kill_all)

    # --- hooks, in lifecycle order ---------------------------------------------------------

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Remember the run order: it tells which files each group collects and, for each
        test, which test of its group comes next (so module fixtures survive between them)."""
        self._items = list(session.items)
        self._following = predispatch.successors(self._items)

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
        self._clock.reset()
        for report in self._clock.timed(item.nodeid, self._reports_for(item, nextitem)):
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
        if not getattr(setupstate, "stack", True):
            return  # nothing set up here (only marked tests so far): nothing to tear down
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
            self._settle_pending(None)
            self.close()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Whatever happened before, no process of ours outlives the session."""
        self.kill_all()
        self._run_root.remove()  # only a private folder made without a basetemp
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
        pending = self._settle_pending(item)
        if pending is not None and placement.key is not None:
            # Sent while the previous test was logged: only its results are left.
            return self._after_shared(
                item, nextitem, info, placement.key, pending.group, pending.flight
            )
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
                flight = self._start(group, item.nodeid, None, settings)
                self._await(group, flight)
            finally:
                if group in self._live:
                    self._live.remove(group)
                shutdown_all([group], SHUTDOWN_TIMEOUT_S)
            outcomes = _decoded_outcomes(flight)
            relay_warnings(outcomes)
            return reports.merge(info, outcomes)

        group = self._shared_group(key, settings)
        next_nodeid = self._next_nodeid(item, nextitem)
        flight = self._start(group, item.nodeid, next_nodeid, settings)
        return self._after_shared(item, nextitem, info, key, group, flight)

    def _after_shared(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        info: reports.ItemInfo,
        key: GroupKey,
        group: RankGroup,
        flight: Flight,
    ) -> list[pytest.TestReport]:
        """Wait for ``item`` in the shared ``group``; when it passed on every rank, send the
        next test before anything of this one is decoded, merged or logged; then keep, end or
        drop the group and merge the reports."""
        keep = self._await(group, flight)
        if keep and flight.passed_everywhere():
            self._predispatch(item, nextitem, key, group)
        outcomes = _decoded_outcomes(flight)
        if not keep:
            self._discard(key)
        elif self._pending is None and self._is_last_of_group(item):
            # Nothing else will run in these ranks: let them end their session now (freeing
            # their memory) rather than idle until the end of ours. Reaped at session end.
            group.request_exit()
            self._groups.pop(key, None)
        relay_warnings(outcomes)
        return reports.merge(info, outcomes)

    def _predispatch(
        self, item: pytest.Item, nextitem: pytest.Item | None, key: GroupKey, group: RankGroup
    ) -> None:
        """Send ``nextitem`` to ``group`` now (``item`` passed on every rank) if nothing left
        to do for ``item`` can change whether or how it runs (the conditions:
        :mod:`~pytest_fp32keep.runner.predispatch`)."""
        placement = self._placements.get(nextitem.nodeid) if nextitem else None
        settings = placement.settings if placement is not None else None
        if nextitem is None or placement is None or settings is None or placement.key != key:
            return
        if settings.isolated or placement.skip or nextitem.nodeid not in self._following:
            return  # (not in the order planned at collection: its successor is unknown)
        if not group.usable() or not predispatch.may_send(item, nextitem, self._config):
            return
        after = self._next_nodeid_by_id(nextitem.nodeid, self._following[nextitem.nodeid])
        flight = self._start(group, nextitem.nodeid, after, settings)
        self._pending = predispatch.Predispatched(nextitem.nodeid, group, flight)

    def _settle_pending(self, item: pytest.Item | None) -> predispatch.Predispatched | None:
        """The test sent ahead, if it is ``item``; a test sent ahead that pytest did not run
        next (another plugin changed the loop, or it stopped) is waited for and dropped."""
        pending, self._pending = self._pending, None
        if pending is None or (item is not None and pending.nodeid == item.nodeid):
            return pending
        self._await(pending.group, pending.flight)
        with contextlib.suppress(Warning):  # under -W error: nothing to fail here
            warnings.warn(predispatch.dropped(pending.nodeid), pytest.PytestWarning, stacklevel=2)
        return None

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
        if (over := options.over_cap(settings.nproc, self._settings)) is not None:
            return Placement(settings, skip=over)
        if settings.backend == "gloo":
            return Placement(settings, GroupKey(settings.nproc, "gloo"))
        devices = self._count_cuda_devices()
        if devices >= settings.nproc:
            return Placement(settings, GroupKey(settings.nproc, "nccl"))
        if settings.backend == "nccl":
            return Placement(settings, skip=nccl_shortfall(settings.nproc, devices))
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
        return self._next_nodeid_by_id(item.nodeid, nextitem.nodeid if nextitem else None)

    def _next_nodeid_by_id(self, nodeid: str, next_id: str | None) -> str | None:
        if next_id is None:
            return None
        placement = self._placements.get(next_id)
        current = self._placements.get(nodeid)
        same_group = placement is not None and current is not None and placement.key == current.key
        if same_group and placement and placement.settings and not placement.settings.isolated:
            return next_id
        if hasattr(self._config, "workerinput"):
            return None
        return self._next_in_group.get(nodeid)

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
            pg_timeout=self._longest_timeout(key, settings) + PG_TIMEOUT_MARGIN_S,
            ready_timeout=max(settings.timeout, MIN_READY_TIMEOUT_S),
        )
        began = time.monotonic()
        try:
            group = RankGroup.start(spec)
        except LaunchError as exc:
            self._launch_failures[key] = (failures + 1, str(exc))
            raise
        finally:
            self._clock.launched(time.monotonic() - began)
        self._launch_failures.pop(key, None)
        self._live.append(group)
        return group

    def _longest_timeout(self, key: GroupKey, settings: options.ItemSettings) -> float:
        """The longest test timeout among the tests this group may run (a marker's
        ``timeout=`` can exceed ``--fsdp-timeout``): the process group must outlast it."""
        timeouts = [
            placement.settings.timeout
            for placement in self._placements.values()
            if placement.key == key and placement.settings is not None
        ]
        return max([settings.timeout, *timeouts])

    def _run_root_dir(self) -> Path:
        """Logs and stack dumps live in the session's basetemp, beside ``tmp_path`` dirs."""
        return self._run_root.path()

    # --- dispatch --------------------------------------------------------------------------

    def _start(
        self, group: RankGroup, nodeid: str, next_nodeid: str | None, run: options.ItemSettings
    ) -> Flight:
        """Send one test to every rank of ``group``, timed out as ``run`` says."""
        flight = Flight(group, nodeid, self._config)
        try:
            flight.start(next_nodeid, seed_for(nodeid), run.timeout, run.timeout_from)
        except BaseException:
            self._discard_group(group)
            raise
        return flight

    def _await(self, group: RankGroup, flight: Flight) -> bool:
        """Wait for a test sent to ``group``; whether the group can be kept for the next."""
        try:
            flight.wait()
        except BaseException:
            # Ctrl-C (or anything unforeseen) while ranks run: never leave them behind.
            self._discard_group(group)
            raise
        self._clock.waited(flight.nodeid, flight.waited)
        if flight.broken:
            flight.collect_faults()
            self._discard_group(group)
        return not flight.broken

    def _discard_group(self, group: RankGroup) -> None:
        for key, known in list(self._groups.items()):
            if known is group:
                del self._groups[key]
        if group in self._live:
            self._live.remove(group)
        group.kill()


def _decoded_outcomes(flight: Flight) -> list[reports.RankOutcome]:
    """Every rank's outcome of ``flight``, its reports decoded, in rank order."""
    flight.decode_reports()
    return [flight.outcomes[rank] for rank in sorted(flight.outcomes)]
