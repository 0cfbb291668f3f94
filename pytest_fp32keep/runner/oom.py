"""Whether a rank killed by SIGKILL was killed by the kernel's out-of-memory killer.

A SIGKILL looks the same whoever sent it; what tells the OOM killer apart is the ``oom_kill``
counter the kernel keeps for every memory cgroup: it counts each process of the cgroup (and of
the cgroups below it) that any OOM kill chose, a system-wide one included. It is readable without
root: ``memory.events`` under cgroup v2, ``memory.oom_control`` under cgroup v1's memory
controller. The controller finds each rank's counter file from ``/proc/PID/cgroup`` once per
group (:func:`counter_file`), reads the counters when a test starts (:func:`read_counts`), and
a rank killed by SIGKILL whose counter rose during the test is reported as the OOM killer's
(:func:`oom_killed`).

The kernel log (``dmesg``) would name the victim, but it is often closed to users
(``kernel.dmesg_restrict``) and inside containers: it is not used. Where no counter can be read
(no ``/proc``, no memory controller mounted at ``/sys/fs/cgroup``), a SIGKILL stays a plain
SIGKILL. The counter is per cgroup, not per process: another process of the same cgroup killed
for memory during the test would be taken as the rank's (the report shows the counter).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

#: Where the cgroup file systems are mounted (v2 alone, v2 beside v1, v1's memory controller).
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")


def counter_file(pid: int, root: Path = CGROUP_ROOT) -> Path | None:
    """The file holding the ``oom_kill`` counter of ``pid``'s memory cgroup, if readable."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2: one unified hierarchy
            candidates += [
                root / relative / "memory.events",
                root / "unified" / relative / "memory.events",
            ]
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / relative / "memory.oom_control")
    return next((path for path in candidates if read_count(path) is not None), None)


def read_count(path: Path) -> int | None:
    """The ``oom_kill`` line of a ``memory.events`` or ``memory.oom_control`` file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def read_counts(paths: Iterable[Path]) -> dict[Path, int]:
    """Each readable counter's value now."""
    counts = {path: read_count(path) for path in paths}
    return {path: count for path, count in counts.items() if count is not None}


def oom_killed(path: Path | None, before: Mapping[Path, int]) -> str | None:
    """Where the counter at ``path`` rose above its value in ``before``: what a SIGKILL report
    adds (who sent it, the evidence, what to do); else ``None``."""
    if path is None or path not in before:
        return None
    now = read_count(path)
    if now is None or now <= before[path]:
        return None
    return (
        "by the kernel's out-of-memory killer (the oom_kill count of the rank's memory cgroup, "
        f"{path}, rose from {before[path]} to {now} during the test): the machine or the "
        "cgroup ran out of memory; use less memory per rank, fewer ranks, or a larger limit"
    )
