"""A group of ranks connected to the controller: start it, watch it, dump its stacks, end it.

A :class:`RankGroup` is one ``torchrun`` invocation (the real launcher and its environment
variables, with a private file rendezvous) and the N ranks it spawns, each connected back to a
loopback socket of ours. Starting and killing the processes is
:mod:`pytest_fp32keep.runner.processes`' job (the one place that does it, shared with
``fp32keep check``); this module adds the connection, readiness, stack dumps and logs.

Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import selectors
import signal
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

from pytest_fp32keep.runner import disk, oom, protocol
from pytest_fp32keep.runner.processes import TorchrunProcess
from pytest_fp32keep.runner.waits import flight_recorder_environment

#: Bound on one blocking send to a rank (a request is a few hundred bytes).
SEND_TIMEOUT_S: Final = 10.0
#: How long the ranks get to write their stacks after SIGUSR1.
STACK_DUMP_WAIT_S: Final = 2.0
#: How often a waiting loop looks at torchrun's liveness.
POLL_S: Final = 0.1
#: Lines of a log shown in a report.
LOG_TAIL_LINES: Final = 40


class LaunchError(RuntimeError):
    """The ranks did not all start; the message says what torchrun and the ranks printed."""


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one group of ranks.

    Attributes:
        nproc: number of ranks.
        backend: the resolved backend, ``"gloo"`` or ``"nccl"``.
        files: the test files the ranks collect (absolute paths).
        pytest_args: arguments every rank's pytest session starts with.
        cwd: the parent's invocation directory (relative paths in the args mean the same).
        run_dir: a fresh folder for this launch: logs, stack dumps, basetemps.
        pg_timeout: process-group timeout in the ranks, seconds.
        ready_timeout: how long the ranks may take to connect, collect and initialise.
    """

    nproc: int
    backend: str
    files: tuple[str, ...]
    pytest_args: tuple[str, ...]
    cwd: Path
    run_dir: Path
    pg_timeout: float
    ready_timeout: float


@dataclasses.dataclass(frozen=True)
class RankExit:
    """How torchrun says a rank ended."""

    rank: int
    exitcode: int
    root_cause: bool

    def describe(self) -> str:
        """``"killed by signal 9 (SIGKILL)"`` or ``"exited with code 3"``."""
        if self.exitcode < 0:
            number = -self.exitcode
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = "unknown signal"
            return f"killed by signal {number} ({name})"
        return f"exited with code {self.exitcode}"

    @property
    def terminated_by_torchrun(self) -> bool:
        """torchrun stops the surviving ranks with SIGTERM once one has failed."""
        return not self.root_cause and self.exitcode == -signal.SIGTERM


@dataclasses.dataclass
class RankHandle:
    """A connected rank: its process id, its end of the control channel, and whether it says
    when a test is blocked in communication (:mod:`pytest_fp32keep.runner.waits`)."""

    rank: int
    pid: int
    channel: protocol.Channel
    observes: bool = False


class RankGroup:
    """One torchrun process and its connected ranks, kept alive across tests."""

    def __init__(self, spec: LaunchSpec, process: TorchrunProcess) -> None:
        self.spec = spec
        self.process = process
        self.ranks: dict[int, RankHandle] = {}
        self.collection_errors: list[str] = []
        self.dead = False  # killed, or found broken: never to be used again
        self._selector: selectors.BaseSelector | None = None

    def selector(self) -> selectors.BaseSelector:
        """The ranks' channels registered for reading (key data: the rank), made once and
        kept while the group lives: each test waits on it without setting it up again."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
            for rank, handle in self.ranks.items():
                self._selector.register(handle.channel, selectors.EVENT_READ, rank)
        return self._selector

    # --- start ---------------------------------------------------------------------------

    @classmethod
    def start(cls, spec: LaunchSpec) -> RankGroup:
        """Start torchrun and wait until every rank has connected, collected and is ready.

        Raises ``LaunchError`` (after killing whatever started) if torchrun exits early or
        the ranks are not ready within ``spec.ready_timeout``.
        """
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))  # the OS picks the port: no guessing, no clash
        listener.listen(spec.nproc)
        env = dict(os.environ)
        env.update(
            {
                protocol.ENV_CONTROLLER: f"127.0.0.1:{listener.getsockname()[1]}",
                protocol.ENV_RUN_DIR: str(spec.run_dir),
                protocol.ENV_BACKEND: spec.backend,
                protocol.ENV_PG_TIMEOUT: str(spec.pg_timeout),
                # The ranks get the parent's arguments through the command line, filtered;
                # the environment must not add them a second time.
                "PYTEST_ADDOPTS": "",
            }
        )
        flight_recorder_environment(env)  # the ranks' watch needs it (torch 2.9: off by default)
        process = TorchrunProcess.spawn(
            spec.nproc,
            "pytest_fp32keep.runner.rank_session",
            [*spec.pytest_args, *spec.files],
            work_dir=spec.run_dir,
            cwd=spec.cwd,
            env=env,
            log=spec.run_dir / "torchrun.log",
        )
        group = cls(spec, process)
        try:
            group._await_ready(listener)
        except BaseException:
            group.kill()
            raise
        finally:
            listener.close()
        return group

    def _await_ready(self, listener: socket.socket) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        ready: set[int] = set()
        try:
            while len(ready) < self.spec.nproc:
                if not self.process.running():
                    raise LaunchError(
                        self._launch_failure(f"torchrun exited with code {self.process.returncode}")
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stacks = self.dump_stacks([r for r in self.ranks if r not in ready])
                    raise LaunchError(
                        self._launch_failure(
                            f"not every rank was ready within {self.spec.ready_timeout:g} s "
                            f"({len(ready)} of {self.spec.nproc})",
                            stacks,
                        )
                    )
                for key, _ in selector.select(min(POLL_S, remaining)):
                    if key.fileobj is listener:
                        sock, _ = listener.accept()
                        sock.settimeout(SEND_TIMEOUT_S)
                        channel = protocol.Channel(sock)
                        selector.register(channel, selectors.EVENT_READ, None)
                        continue
                    channel = key.fileobj  # type: ignore[assignment]
                    try:
                        messages = channel.read_available()
                        for message in messages:
                            self._on_startup_message(channel, message, ready)
                    except (protocol.ConnectionClosed, OSError):
                        selector.unregister(channel)
                        channel.close()
                        continue  # torchrun will notice the dead rank and exit
                    except (protocol.ProtocolError, ValueError, TypeError, KeyError):
                        # Not our protocol (malformed frames, not JSON, fields missing or of
                        # the wrong type; or a stranger on the port): refuse the connection.
                        selector.unregister(channel)
                        channel.close()
                        self._forget(channel)
        finally:
            selector.close()

    def _on_startup_message(
        self, channel: protocol.Channel, message: protocol.Message, ready: set[int]
    ) -> None:
        """Take in one start-up message; raise ``ProtocolError`` (or the ``ValueError``,
        ``TypeError``, ``KeyError`` of a bad field) for anything a rank of ours never sends."""
        handle = next((h for h in self.ranks.values() if h.channel is channel), None)
        if message["type"] == protocol.HELLO and handle is None:
            if message.get("token") != self.process.token:
                # Not one of ours: some other local process found the port.
                raise protocol.ProtocolError("a hello without this launch's token")
            rank = int(message["rank"])
            if not 0 <= rank < self.spec.nproc or rank in self.ranks:
                raise protocol.ProtocolError(f"a hello from rank {rank!r}")
            self.ranks[rank] = RankHandle(rank, int(message["pid"]), channel)
        elif message["type"] == protocol.READY and handle is not None:
            errors = [str(error) for error in message.get("collection_errors", [])]
            handle.observes = bool(message.get("observes"))
            ready.add(handle.rank)
            self.collection_errors += errors
        else:
            raise protocol.ProtocolError(f"{message['type']!r:.50} before this channel's hello")

    def _forget(self, channel: protocol.Channel) -> None:
        """Drop a refused channel from the ranks, if a hello had registered it."""
        for rank, handle in list(self.ranks.items()):
            if handle.channel is channel:
                del self.ranks[rank]

    def _launch_failure(self, what: str, stacks: dict[int, str] | None = None) -> str:
        lines = [
            f"fsdp2: could not start {self.spec.nproc} ranks ({self.spec.backend}): {what}.",
            *filter(None, [disk.full_note(self.spec.run_dir)]),
            "Command: " + " ".join(self.process.argv),
            f"Logs: {self.spec.run_dir}",
            "--- torchrun output (end) ---",
            self.torchrun_log_tail(),
        ]
        for rank in range(self.spec.nproc):
            tail = self.rank_log_tail(rank)
            if tail:
                lines += [f"--- rank {rank} log (end) ---", tail]
            if stacks and stacks.get(rank):
                lines += [f"--- rank {rank} stacks ---", stacks[rank]]
        return "\n".join(lines)

    # --- health ----------------------------------------------------------------------------

    def launcher_running(self) -> bool:
        """Whether torchrun is still running."""
        return self.process.running()

    def usable(self) -> bool:
        """Whether the group can take another test: running, all ranks connected and idle."""
        if self.dead or not self.launcher_running() or len(self.ranks) != self.spec.nproc:
            return False
        # Between tests a rank sends nothing: a readable channel means it closed (end of
        # stream, an error) or misbehaved. One poll of the kept selector sees every rank.
        return not self.selector().select(0)

    @functools.cached_property
    def oom_counters(self) -> dict[int, Path]:
        """Each rank's memory cgroup ``oom_kill`` counter file (:mod:`.oom`), found once: a
        dead rank's cgroup can no longer be read."""
        found = {rank: oom.counter_file(handle.pid) for rank, handle in self.ranks.items()}
        return {rank: path for rank, path in found.items() if path is not None}

    def send_all(self, message: protocol.Message) -> list[int]:
        """Send ``message`` to every rank; return the ranks that could not be reached."""
        unreachable: list[int] = []
        for rank, handle in sorted(self.ranks.items()):
            try:
                handle.channel.send(message)
            except OSError:
                unreachable.append(rank)
        return unreachable

    # --- diagnosis -------------------------------------------------------------------------

    def dump_stacks(self, ranks: Iterable[int]) -> dict[int, str]:
        """Ask ``ranks`` for every thread's Python stack (SIGUSR1) and return what they wrote."""
        offsets: dict[int, int] = {}
        for rank in ranks:
            handle = self.ranks.get(rank)
            if handle is None or not self.process.owns(handle.pid):
                continue
            path = protocol.stack_file(self.spec.run_dir, rank)
            offsets[rank] = path.stat().st_size if path.exists() else 0
            with contextlib.suppress(OSError):
                os.kill(handle.pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        sizes: dict[int, int] = {}
        while offsets and time.monotonic() < deadline:
            time.sleep(0.05)
            current = {r: _size(protocol.stack_file(self.spec.run_dir, r)) for r in offsets}
            grown = all(current[r] > offsets[r] for r in offsets)
            if grown and current == sizes:
                break  # every file grew and stopped growing: the dumps are complete
            sizes = current
        stacks: dict[int, str] = {}
        for rank, offset in offsets.items():
            path = protocol.stack_file(self.spec.run_dir, rank)
            with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
                f.seek(offset)
                stacks[rank] = (
                    f.read().strip()
                    or " ".join(["(the rank wrote no stack)", disk.full_note(path.parent)]).strip()
                )
        return stacks

    def wait_launcher_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for torchrun to exit by itself; whether it did."""
        return self.process.wait(timeout) is not None

    def rank_exits(self) -> dict[int, RankExit]:
        """How torchrun reported the ranks that ended (from its failure summary)."""
        return parse_torchrun_failures(_read_text(self.spec.run_dir / "torchrun.log"))

    def torchrun_log_tail(self) -> str:
        """The end of torchrun's own output."""
        return _tail(self.spec.run_dir / "torchrun.log")

    def rank_log_tail(self, rank: int, nodeid: str | None = None) -> str:
        """The end of ``rank``'s log (its output outside the per-test capture).

        With ``nodeid``: only what the rank wrote since it started that test (a fatal error,
        a C++ abort message), without pytest's progress characters.
        """
        text = _tail(protocol.rank_log(self.spec.run_dir, rank), lines=10_000)
        if nodeid is None:
            return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
        text = text.rpartition(protocol.log_marker(nodeid))[2]
        lines = [line for line in text.splitlines() if line.strip() and not _PROGRESS.match(line)]
        return "\n".join(lines[-LOG_TAIL_LINES:])

    # --- stop ------------------------------------------------------------------------------

    def request_exit(self) -> None:
        """Ask every rank to end its session (session fixtures tear down); do not wait."""
        if not self.dead and self.launcher_running():
            self.send_all(protocol.exit_message())

    def wait_ranks_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every rank closed its connection (its session ended).

        A rank closes the connection after its pytest session and process group are torn
        down; what is left (interpreter exit, torchrun's own wind-down) is not worth waiting
        for, so the caller kills the group right after.
        """
        deadline = time.monotonic() + timeout
        open_channels = {h.channel for h in self.ranks.values()}
        with selectors.DefaultSelector() as selector:
            for channel in open_channels:
                selector.register(channel, selectors.EVENT_READ)
            while open_channels and self.launcher_running():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                for key, _ in selector.select(min(POLL_S, remaining)):
                    channel = key.fileobj  # type: ignore[assignment]
                    try:
                        channel.read_available()
                    except (protocol.ConnectionClosed, OSError):
                        selector.unregister(channel)
                        open_channels.discard(channel)
        return True

    def kill(self) -> None:
        """SIGKILL every process of this group and reap torchrun. Idempotent, bounded."""
        self.dead = True
        self.process.kill(known_pids=[handle.pid for handle in self.ranks.values()])
        if self._selector is not None:
            self._selector.close()
        for handle in self.ranks.values():
            handle.channel.close()


def shutdown_all(groups: Sequence[RankGroup], timeout: float) -> None:
    """End several groups together: ask all to exit, wait up to ``timeout``, kill the rest."""
    for group in groups:
        group.request_exit()
    deadline = time.monotonic() + timeout
    for group in groups:
        if not group.dead:
            group.wait_ranks_closed(deadline - time.monotonic())
    for group in groups:
        group.kill()  # also for groups that finished: reaps torchrun, sweeps stragglers


#: A line of pytest's quiet progress output ("..F." or "[ 50%]").
_PROGRESS = re.compile(r"^[.sSxXEFfp]*\s*(\[\s*\d+%\])?\s*$")

_FAILURE_BLOCK = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE
)


def parse_torchrun_failures(text: str) -> dict[int, RankExit]:
    """Read torch elastic's ``ChildFailedError`` summary: rank, exit code, root cause."""
    head, _, root_part = text.partition("Root Cause")
    exits: dict[int, RankExit] = {}
    for part, root in ((head, False), (root_part, True)):
        for match in _FAILURE_BLOCK.finditer(part):
            rank = int(match.group(1))
            exits[rank] = RankExit(rank, int(match.group(2)), root)
    return exits


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])
