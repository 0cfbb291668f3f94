"""Whether the folder the runner writes in is on a full file system, said in one sentence.

The runner writes torchrun's log, each rank's log and stack dumps, the rendezvous files and the
ranks' spilled reports under the session's basetemp (by default under ``TMPDIR``). On a full
disk those writes fail, or torchrun dies before it can write a word of its own log; without a
look at the disk the report would say only "torchrun exited with code 1". :func:`full_note` is
that look: the folder and how much is free, when the file system is (all but) full.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

#: Below this many free bytes the file system counts as full (a rank log's line, a report's
#: spilled text, torchrun's rendezvous files need more).
FULL_BELOW_BYTES: Final = 1 << 20


Statvfs = Callable[[str], os.statvfs_result]


def free_bytes(folder: Path, statvfs: Statvfs = os.statvfs) -> int | None:
    """Bytes an unprivileged writer may still use on ``folder``'s file system (the nearest
    existing ancestor's), or ``None`` where unknown."""
    for candidate in (folder, *folder.parents):
        try:
            stat = statvfs(str(candidate))
        except FileNotFoundError:
            continue
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize
    return None


def full_note(folder: Path, statvfs: Statvfs = os.statvfs) -> str:
    """``"the file system of FOLDER is full (N bytes free): ..."`` where it is, else ``""``."""
    free = free_bytes(folder, statvfs)
    if free is None or free >= FULL_BELOW_BYTES:
        return ""
    return (
        f"the file system of {folder} is full ({free} bytes free; No space left on device): "
        "free space there, or point TMPDIR (or --basetemp) at a file system with room"
    )
