"""The one place that starts and kills rank processes: a ``torchrun`` and everything below it.

Both the plugin's :class:`~pytest_fp32keep.runner.launcher.RankGroup` and ``fp32keep check``
start their ranks with :meth:`TorchrunProcess.spawn` and end them with
:meth:`TorchrunProcess.kill`; the ranks initialise their process group with
:func:`init_process_group_kwargs`.

Nothing listens on a non-loopback address (``docs/security.md``): torchrun's rendezvous and the
ranks' process group use ``FileStore`` files in a fresh ``0700`` folder instead of a ``TCPStore``
(which binds to every interface whatever host it is given), the agent shares no store, and
gloo's and NCCL's own sockets are bound to loopback unless the user chose an interface.

Why killing needs care: torchrun (torch elastic) starts every worker in a session of its own,
so killing torchrun's process group leaves the ranks alive. :meth:`TorchrunProcess.kill`
therefore sends SIGKILL to every process that descends from torchrun, to every process that
carries this launch's token in its environment (the ranks and whatever they started, even once
orphaned), and to torchrun's own process group. The token check also protects against PID reuse.

torchrun is started in a session of its own (``start_new_session=True``) so that the terminal's
Ctrl-C reaches only the parent, which then kills the tree itself. Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

#: Set for torchrun and so inherited by every rank: marks the processes of one launch.
ENV_TOKEN: Final = "FP32KEEP_TOKEN"
#: The ``FileStore`` file the ranks initialise their process group from.
ENV_PROCESS_GROUP_STORE: Final = "FP32KEEP_PROCESS_GROUP_STORE"
#: The loopback interface, where gloo and NCCL bind unless the user named another one.
LOOPBACK_INTERFACE: Final = "lo"
#: How long torchrun gets to exit after the kill signal before we stop waiting for it.
REAP_TIMEOUT_S: Final = 10.0


def torchrun_argv(nproc: int, module: str, args: Sequence[str], rendezvous: Path) -> list[str]:
    """``python -m torch.distributed.run`` running ``python -m module args`` in ``nproc`` ranks.

    One node, a file rendezvous at ``rendezvous`` (no TCP store, unlike ``--standalone``), no
    restarts, and a short monitor interval so that torch elastic notices a dead rank quickly and
    stops the others.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous}",
        "--rdzv-conf=store_type=file",
        f"--rdzv-id={rendezvous.parent.name}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        module,
        *args,
    ]


def init_process_group_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``dist.init_process_group`` in a rank started by this module.

    The ``FileStore`` of the launch (``init_method=file://...``) with the rank and world size
    torchrun set; in a process that this module did not start, nothing (``env://``).
    """
    store = os.environ.get(ENV_PROCESS_GROUP_STORE)
    if store is None:
        return {}
    return {
        "init_method": Path(store).as_uri(),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


class TorchrunProcess:
    """One running ``torchrun`` and the process tree it spawned, identified by a token."""

    def __init__(self, popen: subprocess.Popen[bytes], token: str, argv: Sequence[str]) -> None:
        self.popen = popen
        self.token = token
        self.argv = tuple(argv)

    @classmethod
    def spawn(
        cls,
        nproc: int,
        module: str,
        args: Sequence[str],
        *,
        work_dir: Path,
        cwd: Path | str | None = None,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
    ) -> TorchrunProcess:
        """Start ``python -m module args`` in ``nproc`` ranks under torchrun, in a new session.

        The rendezvous and process-group stores go to a fresh ``0700`` folder under
        ``work_dir``, which must outlive the ranks. ``env`` replaces the inherited environment
        (default: this process's), plus the token and the store. With ``log``, stdout and
        stderr go to that file; without, they are inherited.
        """
        private = Path(tempfile.mkdtemp(prefix="stores-", dir=work_dir))  # mode 0700
        argv = torchrun_argv(nproc, module, args, private / "rendezvous")
        token = secrets.token_hex(16)
        environment = dict(os.environ if env is None else env)
        environment[ENV_TOKEN] = token
        environment[ENV_PROCESS_GROUP_STORE] = str(private / "process-group")
        # The agent would otherwise host a TCPStore for the ranks, listening on every interface.
        environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if Path("/sys/class/net", LOOPBACK_INTERFACE).exists():
            environment.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
            environment.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
        with contextlib.ExitStack() as stack:
            output = stack.enter_context(open(log, "wb")) if log is not None else None
            popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                start_new_session=True,
            )
        return cls(popen, token, argv)

    @property
    def pid(self) -> int:
        """torchrun's process id."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """torchrun's exit status once it has ended, else ``None``."""
        return self.popen.poll()

    def running(self) -> bool:
        """Whether torchrun is still running."""
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for torchrun to exit; its exit status, or ``None``."""
        try:
            return self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is still a process of this launch (not a reused pid)."""
        if not _HAS_PROC:  # not Linux: trust the pid while it exists
            return _exists(pid)
        return self._marker() in _environ(pid)

    def kill(self, known_pids: Sequence[int] = ()) -> None:
        """SIGKILL every process of this launch and reap torchrun. Idempotent, bounded.

        ``known_pids`` are processes the caller knows first-hand (connected ranks); they are the
        only ones found where ``/proc`` cannot be read.
        """
        pids = set(self.processes(known_pids))
        own_group = os.getpgrp()
        groups = {self.popen.pid}
        for pid in pids:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(pid))
        for pgid in groups - {own_group}:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        for pid in pids - {os.getpid()}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=REAP_TIMEOUT_S)

    def processes(self, known_pids: Sequence[int] = ()) -> list[int]:
        """torchrun's descendants plus every process carrying this launch's token."""
        if not _HAS_PROC:  # not Linux: what we know first-hand
            return [pid for pid in known_pids if self.owns(pid)]
        table = _process_table()
        children: dict[int, list[int]] = {}
        for pid, ppid in table:
            children.setdefault(ppid, []).append(pid)
        found: set[int] = set()
        todo = [self.popen.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        marker = self._marker()
        for pid, _ in table:
            if pid not in found and marker in _environ(pid):
                found.add(pid)
        return sorted(found)

    def _marker(self) -> bytes:
        return f"{ENV_TOKEN}={self.token}".encode()


_HAS_PROC: Final = Path("/proc/self/stat").exists()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, or ``None`` where unknown."""
    if not _HAS_PROC:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            # The command name may hold spaces and parentheses: split after the last ")".
            return f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of ``pid`` (all its threads), or ``None`` where unknown."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # After the command: state is field 3, utime and stime are fields 14 and 15 (in ticks).
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped by a signal, ``t``
    stopped by a tracer, ``Z`` ...), or ``None`` where unknown (gone, no ``/proc``)."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_table() -> list[tuple[int, int]]:
    """``(pid, parent pid)`` of every live (not zombie) process, from ``/proc``."""
    table: list[tuple[int, int]] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: split after the last ")".
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[0] != "Z":
            table.append((int(entry.name), int(fields[1])))
    return table


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
