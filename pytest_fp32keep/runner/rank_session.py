"""The program torchrun starts in every rank: a real pytest session driven in lock-step.

``torchrun ... -m pytest_fp32keep.runner.rank_session <pytest args> <files>``, started by
:mod:`pytest_fp32keep.runner.processes`.

Each rank:

1. sends its stdout/stderr to a per-rank log (so nothing garbles the parent's terminal and a
   crash leaves its last words on disk) and arranges that SIGUSR1 dumps every thread's Python
   stack to a per-rank file (the controller's way to see a hang);
2. connects back to the controller and starts a watchdog thread that ends the process if the
   controller goes away, even while the main thread is stuck in a collective;
3. initialises the default process group once (gloo on CPU, or nccl with device
   ``LOCAL_RANK``) with a bounded timeout, and starts the thread that tells the controller
   when a test is blocked in communication (:mod:`pytest_fp32keep.runner.waits`);
4. runs ``pytest.main`` on the files holding its group's tests; the session collects once and
   then, instead of pytest's loop, serves ``run`` requests one at a time until ``exit``.

Each test runs through the ordinary ``pytest_runtest_protocol`` (fixtures, parametrization,
capture, xfail ...); every phase report goes back in pytest's own serialisable form.

This module imports only the standard library, pytest and the runner's rank-side modules; torch
is imported when the process group is initialised.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import importlib
import importlib.util
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Any, Final

import pytest

from pytest_fp32keep.runner import protocol
from pytest_fp32keep.runner.leftovers import (
    TorchDefaults,
    process_group_problem,
    restored_warning,
)
from pytest_fp32keep.runner.processes import ENV_TOKEN, init_process_group_kwargs
from pytest_fp32keep.runner.rank_context import RANK_CONTEXT_KEY, RankContext
from pytest_fp32keep.runner.spill import spill_report
from pytest_fp32keep.runner.waits import CommunicationWatch, flight_recorder_works

#: Exit status of a rank whose controller vanished (it stops at once, wherever it is).
EXIT_CONTROLLER_GONE: Final = 75
#: The warning pytest gives about this package, imported by ``python -m`` before pytest starts.
REWRITE_WARNING: Final = "Module already imported so cannot be rewritten; pytest_fp32keep"
#: How often the watchdog looks at the controller connection.
WATCHDOG_POLL_S: Final = 0.5

# Kept referenced for the life of the process: faulthandler writes to this file on SIGUSR1.
_stack_dump_file: IO[str] | None = None
# A descriptor of the rank log that pytest's capture never redirects (for test markers).
_log_fd: int | None = None


class RankSessionPlugin:
    """The rank-side pytest plugin: collect once, then run what the controller asks for."""

    def __init__(
        self,
        channel: protocol.Channel,
        context: RankContext,
        spill_dir: Path,
        watch: CommunicationWatch,
    ) -> None:
        self._channel = channel
        self._context = context
        self._watch = watch
        self._config: pytest.Config | None = None
        self._current: str | None = None
        self._collection_errors: list[str] = []
        self._numpy_seed: Any = _numpy_seed_function()
        self._warnings: list[dict[str, Any]] = []  # the current test's, for the parent's summary
        self._spill_dir = spill_dir

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        """Publish the rank context before any other plugin configures (fixtures read it)."""
        self._config = config
        config.stash[RANK_CONTEXT_KEY] = self._context

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Remember collection errors: a test missing here is explained by them."""
        if report.failed:
            self._collection_errors.append(
                f"{report.nodeid or '<session>'}:\n{report.longreprtext}"
            )

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        """Replace pytest's loop: announce readiness, then serve requests until ``exit``."""
        items = {item.nodeid: item for item in session.items}
        self._channel.send(protocol.ready(self._collection_errors, observes=self._watch.observes))
        while True:
            try:
                message = self._channel.receive()
            except (protocol.ConnectionClosed, OSError):
                break  # the controller is gone: finish the session and leave
            if message["type"] == protocol.EXIT:
                break
            if message["type"] == protocol.RUN:
                self._run(session, items, message)
        return True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Send every phase report of the current test as soon as pytest makes it.

        Streaming (rather than one answer at the end) lets the controller see a failure
        while the other ranks may still be stuck, and know in which phase a rank hangs. A
        passed report is coalesced with the next message (:mod:`.protocol`): the controller
        acts only on failures and ``done``, so a passing test wakes it once, not four times.
        """
        if self._current is None or report.nodeid != self._current:
            return
        assert self._config is not None
        spill_report(report, self._spill_dir)
        data = self._config.hook.pytest_report_to_serializable(config=self._config, report=report)
        message = protocol.report(self._current, data)
        self._channel.send(message, coalesce=report.passed)

    def _run(self, session: pytest.Session, items: dict[str, pytest.Item], message: Any) -> None:
        nodeid: str = message["nodeid"]
        item = items.get(nodeid)
        if item is None:
            detail = (
                f"collected no test with id {nodeid!r}; "
                "its id must not depend on the process (for example parametrize ids "
                "built from object reprs)."
            )
            if self._collection_errors:
                detail += "\nCollection errors in the rank:\n" + "\n".join(self._collection_errors)
            self._channel.send(protocol.missing(nodeid, detail))
            return
        _mark_log(nodeid)
        notes: list[str] = []
        problems = _tear_down_leftovers(session, item)
        _seed_everything(int(message["seed"]), self._numpy_seed)
        next_nodeid = message.get("next_nodeid")
        nextitem = items.get(next_nodeid) if next_nodeid else None
        defaults = TorchDefaults.take()
        self._current = nodeid
        self._warnings = []
        self._watch.begin(nodeid)
        try:
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        except Exception:
            notes.append(
                f"pytest's test protocol raised on rank {self._context.rank}:\n"
                + traceback.format_exc()
            )
        finally:
            self._watch.end()
            self._current = None
        if defaults is not None and (changed := defaults.restore()):
            self._warnings.append(restored_warning(item, changed))
        broken = process_group_problem()
        if broken is not None:
            problems.append(broken)
        self._channel.send(
            protocol.done(
                nodeid, notes, problems=problems, warnings=self._warnings, broken=bool(broken)
            )
        )

    def pytest_warning_recorded(
        self, warning_message: warnings.WarningMessage, when: str, nodeid: str
    ) -> None:
        """Keep the current test's warnings for the parent's warnings summary, with the place
        they were raised (the parent reissues them there)."""
        if self._current is not None and when == "runtest":
            category = warning_message.category.__name__
            self._warnings.append(
                protocol.rank_warning(
                    f"{category}: {warning_message.message}",
                    warning_message.filename,
                    warning_message.lineno,
                )
            )


def _tear_down_leftovers(session: pytest.Session, item: pytest.Item) -> list[str]:
    """Tear down fixtures of collectors ``item`` does not belong to.

    The controller passes the next test of this group as ``nextitem`` so module and class
    fixtures survive between tests; when the parent's run order differs from that guess
    (a test skipped in the parent, ``-x``, xdist scheduling), this catches up before
    ``item`` sets up, which pytest would otherwise refuse.
    """
    setup_state = getattr(session, "_setupstate", None)
    stack = getattr(setup_state, "stack", None)
    if setup_state is None or not stack:
        return []
    chain = set(item.listchain())
    if all(node in chain for node in stack):
        return []
    try:
        setup_state.teardown_exact(item)
    except Exception:
        # The earlier test is already reported: this one carries the error, as pytest would
        # report a module fixture's teardown error on the test whose teardown ran it.
        return [
            "tearing down fixtures kept from an earlier test raised before this test:\n"
            + traceback.format_exc()
        ]
    return []


def _numpy_seed_function() -> Any:
    """numpy's global seeding function if numpy is installed, imported on first use."""
    if importlib.util.find_spec("numpy") is None:
        return None

    def seed(value: int) -> None:
        importlib.import_module("numpy").random.seed(value)

    return seed


def _seed_everything(seed: int, numpy_seed: Any) -> None:
    """Same seed on every rank before each test: Python, numpy (if installed), torch."""
    random.seed(seed)
    if numpy_seed is not None:
        numpy_seed(seed)
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.accelerator.is_available():
        torch.manual_seed(seed)  # the CPU generator and every device's
    else:
        # What torch.manual_seed does without an accelerator, minus its cost: it also queues
        # lazy seeding for each device backend (CUDA, XPU, MTIA), and each of those records a
        # traceback of the call (about 1 ms a test, as much as the rest of the rank's dispatch).
        torch.default_generator.manual_seed(seed)


def _redirect_output(log_path: Path) -> None:
    """Point fd 1 and 2 at the rank log; pytest's capture still works per test on top."""
    global _log_fd
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _log_fd = fd


def _mark_log(nodeid: str) -> None:
    """Write a line before each test, so a crash report shows only that test's last words."""
    if _log_fd is not None:
        with contextlib.suppress(OSError):
            os.write(_log_fd, f"\n{protocol.log_marker(nodeid)}\n".encode())


def _install_stack_dumper(path: Path) -> None:
    """SIGUSR1 writes every thread's Python stack to ``path``.

    faulthandler writes from the signal handler in C, so this works while the main thread
    is blocked inside a collective or holds the GIL in a long native call.
    """
    global _stack_dump_file
    _stack_dump_file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=_stack_dump_file, all_threads=True, chain=False)


def _connect(address: str, token: str, rank: int, local_rank: int, world: int) -> protocol.Channel:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.settimeout(None)  # the controller paces the rank; it waits as long as it is told
    channel = protocol.Channel(sock)
    channel.send(protocol.hello(rank, local_rank, world, token))
    return channel


def _watch_controller(sock: socket.socket) -> None:
    """End this process at once when the controller's end of the socket closes.

    The main thread only reads the socket between tests; during a test it may be stuck in a
    collective forever. If the pytest process dies (SIGKILL, ``os._exit`` from a timeout
    plugin), the kernel closes its sockets and this thread notices within a poll period.
    """

    def watch() -> None:
        while True:
            try:
                readable, _, _ = select.select([sock], [], [], WATCHDOG_POLL_S)
                if not readable:
                    continue
                if not sock.recv(1, socket.MSG_PEEK):
                    os._exit(EXIT_CONTROLLER_GONE)
                time.sleep(WATCHDOG_POLL_S)  # a request waits for the main thread
            except (ConnectionResetError, BrokenPipeError):
                # Gone too: a controller that dies with a report of ours unread in its socket
                # resets the connection instead of closing it.
                os._exit(EXIT_CONTROLLER_GONE)
            except (OSError, ValueError):
                return  # the main thread closed the socket: normal shutdown

    threading.Thread(target=watch, name="fp32keep-controller-watchdog", daemon=True).start()


def _init_process_group(context: RankContext, timeout_s: float) -> None:
    """Initialise the default process group once for the life of the rank."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = init_process_group_kwargs()  # the launch's private FileStore: no TCP listener
    if context.backend == "nccl":
        torch.cuda.set_device(context.local_rank)
        device = torch.device("cuda", context.local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device, **store)
    else:
        dist.init_process_group("gloo", timeout=timeout, **store)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    # The tests' FSDP2 modules sit in reference cycles. Collected at interpreter exit, after the
    # group is gone, they can abort the rank (torch 2.13, gloo: "terminate called without an
    # active exception", seen in 3 of 40 exits of a loop of FSDP2 steps; 0 of 40 with this).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; ``argv`` are the pytest arguments and files of the group."""
    args = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ
    rank = int(environ["RANK"])
    context = RankContext(
        rank=rank,
        local_rank=int(environ.get("LOCAL_RANK", rank)),
        world_size=int(environ["WORLD_SIZE"]),
        backend=environ.get(protocol.ENV_BACKEND, "gloo"),
    )
    run_dir = Path(environ[protocol.ENV_RUN_DIR])
    _redirect_output(protocol.rank_log(run_dir, rank))
    _install_stack_dumper(protocol.stack_file(run_dir, rank))
    channel = _connect(
        environ[protocol.ENV_CONTROLLER],
        environ[ENV_TOKEN],
        rank,
        context.local_rank,
        context.world_size,
    )
    _watch_controller(channel.sock)
    _init_process_group(context, float(environ.get(protocol.ENV_PG_TIMEOUT, "600")))
    watch = CommunicationWatch(channel, observes=flight_recorder_works())
    watch.start()
    args += ["-q", f"--basetemp={protocol.rank_basetemp(run_dir, rank)}"]
    # ``python -m`` imported this package before pytest could mark it for assertion rewriting;
    # under -W error / filterwarnings=error that warning would stop every rank's session.
    # Appended last, so it wins over the inherited filters for exactly this message.
    args += ["-W", f"ignore:{REWRITE_WARNING}:pytest.PytestAssertRewriteWarning"]
    if "no:cacheprovider" not in args:
        # A private cache: the rank must not overwrite the parent's last-failed list.
        args += ["-o", f"cache_dir={run_dir / f'cache-rank{rank}'}"]
    try:
        plugin = RankSessionPlugin(channel, context, run_dir / f"spilled-rank{rank}", watch)
        code = pytest.main(args, plugins=[plugin])
    finally:
        _destroy_process_group()
        channel.close()
    # Failed tests are the controller's business; the rank itself only fails when its
    # session could not run (usage error, internal error, interrupted).
    served = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)
    return 0 if code in served else int(code)


if __name__ == "__main__":
    sys.exit(main())
