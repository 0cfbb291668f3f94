"""Which TCP sockets a tree of processes listens on, read from ``/proc`` (Linux only).

A socket is matched to a process through ``/proc/PID/fd`` (``socket:[INODE]``) and to its local
address through ``/proc/net/tcp`` and ``/proc/net/tcp6`` (state ``0A`` is LISTEN). Used by the
security tests: nothing a session starts may listen on a non-loopback address.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"


@dataclasses.dataclass(frozen=True)
class Listener:
    """One listening socket: who holds it, on which table, at which local address."""

    pid: int
    table: str  # "tcp" or "tcp6"
    address: str  # /proc's hex form, e.g. "0100007F:1F90"

    @property
    def loopback(self) -> bool:
        """Bound to 127.0.0.0/8 (IPv4, or IPv4-mapped IPv6) or to ::1."""
        host = self.address.partition(":")[0]
        if self.table == "tcp":
            return host.endswith("7F")  # little-endian: the first octet is last
        if host == "00000000000000000000000001000000":  # ::1
            return True
        return host.startswith("0000000000000000FFFF0000") and host.endswith("7F")

    def __str__(self) -> str:
        command = _read(Path(f"/proc/{self.pid}/cmdline")).replace("\0", " ").strip()
        return f"pid {self.pid} ({command[:120]}) listens on {self.table} {self.address}"


def listeners(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket held by one of ``pids``."""
    listening: dict[str, tuple[str, str]] = {}
    for table in ("tcp", "tcp6"):
        for line in _read(Path(f"/proc/net/{table}")).splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN:
                listening[fields[9]] = (table, fields[1])
    found = []
    for pid in pids:
        for inode in _socket_inodes(pid):
            if inode in listening:
                table, address = listening[inode]
                found.append(Listener(pid, table, address))
    return found


def process_tree(root: int) -> list[int]:
    """``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _read(Path(entry.path) / "stat")
            if stat:
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry.name)
                )
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def parent_of(pid: int) -> int:
    """The parent process id of ``pid``."""
    return int(_read(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[1].split()[1])


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        entries = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
