"""Marked tests run in place in a world another launcher started (torchrun, srun): SPMD.

Registered by ``plugin.py`` instead of the controller when :mod:`.launched` finds that pytest
itself is one process of a launched world. Every process runs the same pytest session; once
collection finds a marked test:

1. the default process group is initialised from the launcher's ``env://`` variables (gloo on
   CPU, or NCCL on device ``LOCAL_RANK``; ``--fsdp-backend`` as in the local mode), plus a side
   gloo group for the plugin's own exchanges, so that a test's traffic never mixes with them;
2. every rank's list of collected node ids is compared; a difference ends the session before
   any test runs, naming the tests (:mod:`.collection_agreement`);
3. every test then runs in every rank, in the same order; after each phase the ranks exchange
   their serialised reports (one ``all_gather_object`` on the side group, bounded by the longest
   test timeout) and each replaces its own report by the merged one
   (:func:`.reports.merge_phase`): a phase passes only if every rank passed it, a failure names
   the failing ranks and shows their tracebacks, merged. Every rank then takes the same
   decisions (run the call phase, ``-x``) and ends with the same exit status;
4. only rank 0 writes to the terminal: the other ranks' terminal reporter is blocked; torch's
   defaults a test changed are put back after it, with the local mode's warning, and a test
   that destroys the default process group ends the run (:mod:`.leftovers`);
5. a test that does not finish within its timeout ends the run with every rank's stack on rank 0
   (:mod:`.spmd_watch`); a launcher's SIGTERM (it stops every rank when one fails or dies), or
   an agreement a dead rank never joins, ends it naming the test that was running and the rank
   that died (:mod:`.spmd_roll_call`).

The launcher owns the processes: the plugin starts, kills and restarts none, and opens no
listener beyond the process groups the launcher's rendezvous brings up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Final

import pytest

from pytest_fp32keep.runner import options, reports
from pytest_fp32keep.runner.collection_agreement import differences
from pytest_fp32keep.runner.controller import seed_for
from pytest_fp32keep.runner.launched import LaunchedWorld
from pytest_fp32keep.runner.leftovers import TorchDefaults, process_group_problem, restored_warning
from pytest_fp32keep.runner.rank_context import RANK_CONTEXT_KEY, RankContext
from pytest_fp32keep.runner.rank_session import (
    _destroy_process_group,
    _init_process_group,
    _numpy_seed_function,
    _seed_everything,
)
from pytest_fp32keep.runner.rank_warnings import relay_warnings
from pytest_fp32keep.runner.spmd_roll_call import RollCall, describe
from pytest_fp32keep.runner.spmd_watch import HangWatch

if TYPE_CHECKING:
    from collections.abc import Generator

PLUGIN_NAME: Final = "fp32keep-spmd"
#: The exchange after a phase waits for the slowest rank's phase: longer than any test.
EXCHANGE_MARGIN_S: Final = 60.0


def register(
    config: pytest.Config, settings: options.SessionSettings, world: LaunchedWorld
) -> None:
    """Run this session in place in ``world``; every rank but 0 writes nothing to the terminal.

    Raises ``pytest.UsageError`` where pytest-xdist would start workers (``-n``, ``--tx``).
    """
    _refuse_xdist(config, world)
    if world.rank != 0:
        # As ``-p no:terminal``: blocked before the terminal plugin registers its reporter (or
        # removed if it already has), so the header, progress and summary come from rank 0 only.
        config.pluginmanager.set_blocked("terminalreporter")
    # The terminal as it is now, before pytest captures fd 1 around each test: where rank 0's
    # hang watch writes when a test never returns.
    terminal_fd = os.dup(1) if world.rank == 0 else -1
    config.pluginmanager.register(SpmdSession(config, settings, world, terminal_fd), PLUGIN_NAME)


def _refuse_xdist(config: pytest.Config, world: LaunchedWorld) -> None:
    """xdist's workers would each run a copy of the session in every rank: the ranks' tests
    would no longer run in step (each worker a world of its own, sharing one process group)."""
    workers = config.getoption("numprocesses", None)
    hosts = config.getoption("tx", None)
    if not workers and not hosts:
        return
    given = f"-n {workers}" if workers else f"--tx {' '.join(map(str, hosts))}"
    raise pytest.UsageError(
        f"{given} (pytest-xdist) in a world {world.launcher} launched: every launched process "
        "already runs this session as one rank, in step with the others, and xdist workers "
        "would split the tests between processes that are not ranks. Drop -n (or use -n 0), "
        "or run pytest outside the launcher (the plugin starts its own ranks: -n works there), "
        "or --fsdp-launcher=local in every process"
    )


class SpmdSession:
    """One rank's part in a session run SPMD over a launched world."""

    def __init__(
        self,
        config: pytest.Config,
        settings: options.SessionSettings,
        world: LaunchedWorld,
        terminal_fd: int = -1,
    ) -> None:
        self._config = config
        self._terminal_fd = terminal_fd
        self._watch: HangWatch | None = None
        self._roll: RollCall | None = None  # each rank's last step, for naming a rank that died
        self._settings = settings
        self._world = world
        self._side: Any = None  # the side gloo group, once the session has marked tests
        self._timeout_s = settings.timeout + EXCHANGE_MARGIN_S
        self._numpy_seed: Any = _numpy_seed_function()
        self._current: str | None = None  # the test running now, for a launcher's SIGTERM
        self._defaults: TorchDefaults | None = None  # torch's, before the running test
        self._previous_sigterm: Any = None
        self._ending = False  # this rank ends the session, naming the cause
        self._group_destroyed = False  # by the test that ran last: no leaving together

    def pytest_report_header(self, config: pytest.Config) -> str:
        """Say, on rank 0, that this session is one of a launched world."""
        return (
            f"fsdp2: launched world of {self._world.world_size} processes "
            f"({self._world.launcher}); tests run in place on every rank, rank 0 reports"
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """With a marked test collected: form the process groups, then refuse a collection that
        differs between the ranks before any test runs."""
        marked = [item for item in session.items if options.is_marked(item)]
        if not marked:
            return  # nothing of the plugin's: the session runs as if it were not installed
        self._timeout_s = self._longest_timeout(marked) + EXCHANGE_MARGIN_S
        self._form_groups()
        collected = self._exchange([item.nodeid for item in session.items], "collected tests")
        problem = differences(collected)
        if problem is not None:
            pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        """Remember the running test (a launcher's SIGTERM names it) and torch's defaults (put
        back after it, as in the local mode), and arm the hang watch."""
        self._current = item.nodeid
        self._defaults = TorchDefaults.take() if self._side is not None else None
        if self._watch is not None:
            self._watch.begin(item.nodeid, *self._item_timeout(item))

    def pytest_runtest_logfinish(self) -> None:
        """The test's last agreement is done on every rank: disarm the hang watch."""
        if self._watch is not None:
            self._watch.end()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        """For the hang watch's report and the roll call's."""
        self._doing("call", item.nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        """For the hang watch's report and the roll call's."""
        self._doing("teardown", item.nodeid)

    def _doing(self, when: str, nodeid: str) -> None:
        if self._watch is not None:
            self._watch.doing(f"in {when}")
        if self._roll is not None:
            self._roll.doing(f"the {when} of {nodeid}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """A marked test runs here only if its marker fits the launched world; seeded the same
        on every rank, as in the local mode."""
        self._doing("setup", item.nodeid)
        if self._side is None or not options.is_marked(item):
            return
        context = self._config.stash[RANK_CONTEXT_KEY]
        session = dataclasses.replace(self._settings, nproc=context.world_size, backend="auto")
        try:
            settings = options.item_settings(item, session)
        except options.MarkerError as exc:
            pytest.fail(str(exc), pytrace=False)
        reason = None
        if settings.nproc != context.world_size:
            reason = (
                f"fsdp2: the marker asks for nproc={settings.nproc}; the world "
                f"{self._world.launcher} launched has {context.world_size} processes"
            )
        elif settings.backend not in ("auto", context.backend):
            reason = (
                f"fsdp2: the marker asks for backend {settings.backend}; the launched world "
                f"runs {context.backend}"
            )
        if reason is not None:
            # Located at the test, as a skip marker's (pytest's skipping plugin does the same).
            raise pytest.skip.Exception(reason, _use_item_location=True)
        _seed_everything(seed_for(item.nodeid), self._numpy_seed)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """Replace this rank's report of a phase by the one every rank agrees on."""
        report = yield
        if self._side is None:
            return report
        config = self._config
        if self._watch is not None:
            self._watch.doing(f"done with its {call.when}, waiting for the other ranks")
        self._end_if_group_destroyed(item, call.when)
        restored = self._restore_defaults(item) if call.when == "teardown" else []
        data = config.hook.pytest_report_to_serializable(config=config, report=report)
        gathered = self._exchange(
            {"nodeid": item.nodeid, "when": call.when, "report": data, "warnings": restored},
            f"the {call.when} of {item.nodeid}",
        )
        strays = [
            f"rank {rank} ran the {entry['when']} of {entry['nodeid']}"
            for rank, entry in enumerate(gathered)
            if (entry["nodeid"], entry["when"]) != (item.nodeid, call.when)
        ]
        if strays:
            pytest.exit(
                f"fsdp2: the ranks are out of step at the {call.when} of {item.nodeid}: "
                + "; ".join(strays),
                returncode=pytest.ExitCode.INTERNAL_ERROR,
            )
        outcomes = [
            reports.RankOutcome(
                rank,
                reports=[
                    config.hook.pytest_report_from_serializable(config=config, data=entry["report"])
                ],
                warnings=entry["warnings"],
            )
            for rank, entry in enumerate(gathered)
        ]
        relay_warnings(outcomes)  # inside the test's warnings capture: its summary shows them
        return reports.merge_phase(reports.ItemInfo.from_item(item), report.when, outcomes)

    def _restore_defaults(self, item: pytest.Item) -> list[dict[str, Any]]:
        """Put back torch's defaults the test changed; the warning that says so (as the local
        mode's), for every rank's summary, naming the ranks where it changed them."""
        defaults, self._defaults = self._defaults, None
        if defaults is None or not (changed := defaults.restore()):
            return []
        return [restored_warning(item, changed)]

    def _end_if_group_destroyed(self, item: pytest.Item, when: str) -> None:
        """A test that destroyed the default process group (and with it the plugin's side
        group) ends the run: the launcher's world cannot be formed again here, and the next
        test would wait for ever in its first collective."""
        if process_group_problem() is None:
            return
        why = f"{item.nodeid} destroyed the default process group in its {when}"
        self._group_destroyed = True
        if self._roll is not None:
            self._ending = True
            self._roll.ended(why, cause=True)
        pytest.exit(
            f"fsdp2: rank {self._world.rank}: {why} (dist.destroy_process_group(): every "
            f"group goes, the plugin's own too); the run ends here: the world "
            f"{self._world.launcher} launched cannot be formed again, and the next test would "
            "wait for ever in its first collective. Leave the group to the plugin (it destroys "
            "it at the end), or run such code with a group of its own (dist.new_group)",
            returncode=pytest.ExitCode.INTERRUPTED,
        )

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Leave together, then destroy the process groups this session formed.

        A rank that exits non-zero makes the launcher terminate its peers at once: without the
        barrier, rank 0 could be stopped before its report reaches the terminal.
        """
        if self._side is None:
            return
        import torch.distributed as dist

        sys.stdout.flush()
        if not self._group_destroyed:
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to wait for
                dist.barrier(group=self._side)
        # else: a peer that did not destroy it may wait in an agreement on the side group; a
        # barrier there would match nothing. This rank's exit closes its connections, which
        # ends that wait at once.
        self._side = None
        if self._watch is not None:
            self._watch.end()
            self._watch = None
        if self._terminal_fd >= 0:
            os.close(self._terminal_fd)
            self._terminal_fd = -1
        signal.signal(signal.SIGTERM, self._previous_sigterm)
        _destroy_process_group()

    def _terminated(self, signum: int, frame: Any) -> None:
        """The launcher stops every rank when one fails (exits non-zero, dies): end the session
        with the cause, so rank 0's report says it instead of vanishing."""
        if self._ending:
            return  # already ending, naming the cause (the launcher kills after its own grace)
        during = f" during {self._current}" if self._current else ""
        cause = self._silent_ranks("stopped by the launcher") or (
            "another rank died or failed; the launcher's log names it"
        )
        pytest.exit(
            f"fsdp2: rank {self._world.rank} was stopped by the launcher ({self._world.launcher}, "
            f"SIGTERM){during}: {cause}",
            returncode=128 + signal.SIGTERM,
        )

    def _silent_ranks(self, why: str) -> str:
        """This rank ends through the plugin, saying so in the store; on rank 0, the ranks that
        did not say the same in a bounded grace (they died), named, else ``""``."""
        if self._roll is None:
            return ""
        self._ending = True
        self._roll.ended(why)
        if self._world.rank != 0:
            return ""
        silent = describe(self._roll.silent(), self._world.launcher)
        return "; ".join(filter(None, [*self._roll.causes(), silent]))

    # --- the process groups ----------------------------------------------------------------

    def _form_groups(self) -> None:
        """The default group from the launcher's ``env://`` variables, and the side group."""
        import torch
        import torch.distributed as dist

        world = self._world
        os.environ.update(world.init_environment())  # SLURM's names -> env://'s
        backend = self._backend(torch)
        context = RankContext(world.rank, world.local_rank, world.world_size, backend)
        if dist.is_initialized():
            raise pytest.UsageError(
                "fsdp2: the default process group was initialised before the session's tests "
                "(a conftest or plugin); under an external launcher the plugin initialises it "
                "once collection finds a marked test: remove that initialisation"
            )
        _init_process_group(context, self._timeout_s)
        timeout = datetime.timedelta(seconds=self._timeout_s)
        self._side = dist.new_group(backend="gloo", timeout=timeout)
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._terminated)
        self._watch = HangWatch(world.rank, world.world_size, world.launcher, self._terminal_fd)
        self._roll = RollCall(world.rank, world.world_size)
        self._config.stash[RANK_CONTEXT_KEY] = context

    def _backend(self, torch: Any) -> str:
        """``--fsdp-backend`` for this rank: nccl needs a CUDA device at index ``LOCAL_RANK``."""
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        has_device = devices > self._world.local_rank
        if self._settings.backend == "nccl" and not has_device:
            raise pytest.UsageError(
                f"--fsdp-backend=nccl: rank {self._world.rank} has LOCAL_RANK="
                f"{self._world.local_rank} but sees {devices} CUDA devices; launch at most "
                f"{devices} processes per node, or use --fsdp-backend=gloo"
            )
        if self._settings.backend == "gloo" or not has_device:
            return "gloo"
        return "nccl"

    def _exchange(self, payload: Any, what: str) -> list[Any]:
        """Every rank's ``payload``, in rank order; a rank that does not join within the
        timeout ends the session, saying so (the launcher, not the plugin, restarts)."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self._world.world_size
        try:
            dist.all_gather_object(gathered, payload, group=self._side)
        except Exception as exc:
            cause = self._silent_ranks(f"could not exchange {what}") or (
                f"a rank died, or did not finish within {self._timeout_s:g} s; the launcher's "
                "log names it"
            )
            pytest.exit(
                f"fsdp2: rank {self._world.rank} could not exchange {what} with the other "
                f"ranks ({type(exc).__name__}: {_first_line(exc)}): {cause}",
                returncode=pytest.ExitCode.INTERRUPTED,
            )
        return gathered

    def _item_timeout(self, item: pytest.Item) -> tuple[float, str]:
        """The marker's ``timeout``, else ``--fsdp-timeout`` (unmarked tests and bad markers),
        with its wording for a hang's report (as the local mode's: ``options.timeout_words``)."""
        session = (self._settings.timeout, self._settings.timeout_from)
        if not options.is_marked(item):
            return session
        try:
            settings = options.item_settings(item, self._settings)
        except options.MarkerError:
            return session
        return settings.timeout, settings.timeout_from

    def _longest_timeout(self, marked: list[pytest.Item]) -> float:
        """The longest test timeout the session's markers ask for (a bad marker counts as the
        session's; its test fails in setup)."""
        return max([self._settings.timeout, *(self._item_timeout(item)[0] for item in marked)])


def _first_line(exc: BaseException) -> str:
    """An exception's first line: torch's distributed errors carry C++ stacks after it."""
    return (str(exc).strip().splitlines() or [""])[0]
