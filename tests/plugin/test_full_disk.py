"""A full disk where the runner writes is named: the folder and its free space.

The inner session runs on a 64 MiB tmpfs (its files, its basetemp, so the runner's logs and
rendezvous files); a test fills it, the next one loses a rank, and fresh ranks cannot start: the
report must say the disk is full, where. Mounting a tmpfs needs root (CAP_SYS_ADMIN); elsewhere
that test is skipped saying why, and the unit tests below check the same verdicts through a
seam (a fake ``statvfs``, a spill folder that cannot be written).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_fp32keep.runner import disk, spill
from tests.error_bounds import RANK_FAULT_BOUND_S, note_elapsed
from tests.plugin._inner import InnerProject, failure_section, leftover_processes, new_tag

TESTS = """
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.fsdp2


def test_fill_the_disk(fsdp2_rank):
    if fsdp2_rank == 0:
        with open(os.path.join(os.path.dirname(__file__), "filler"), "wb") as f:
            with pytest.raises(OSError, match="No space left on device"):
                while True:
                    f.write(b"x" * (1 << 20))
                    f.flush()
    dist.barrier()


def test_lose_a_rank(fsdp2_rank):
    if fsdp2_rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_needs_fresh_ranks():
    dist.all_reduce(torch.ones(1))
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, unmounted afterwards; skipped where mounting is not permitted."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_is_named_when_fresh_ranks_cannot_start(small_disk: Path) -> None:
    project = InnerProject(small_disk, new_tag())
    project.write(test_full=TESTS)
    try:
        result = project.run("-rA", "--fsdp-timeout=60")
        result.assert_outcomes(passed=1, failed=1, errors=1)
        text = failure_section(result.stdout.str(), "test_needs_fresh_ranks")
        assert "fsdp2: could not start 2 ranks (gloo)" in text
        assert f"the file system of {small_disk}" in text, text
        assert "is full (" in text and "No space left on device" in text
        assert result.duration < RANK_FAULT_BOUND_S + 60, result.duration  # no timeout waited
        note_elapsed(result.duration)
        assert leftover_processes(project.tag) == []
    finally:
        project.kill_leftovers()


class FakeStat:
    """What ``os.statvfs`` says of a file system with ``free`` bytes left."""

    def __init__(self, free: int) -> None:
        self.f_bavail = free // 4096
        self.f_frsize = 4096


def test_the_note_names_a_full_folder_and_its_free_space(tmp_path: Path) -> None:
    note = disk.full_note(tmp_path / "not-yet", statvfs=lambda _: FakeStat(8192))  # type: ignore[arg-type,return-value]
    assert note.startswith(f"the file system of {tmp_path / 'not-yet'} is full (8192 bytes free")
    assert "TMPDIR" in note


def test_a_folder_with_room_gets_no_note(tmp_path: Path) -> None:
    # Negative control: 10 MiB free is not full.
    assert disk.full_note(tmp_path, statvfs=lambda _: FakeStat(10 << 20)) == ""  # type: ignore[arg-type,return-value]


def test_a_report_too_long_still_travels_when_its_spill_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)  # the seam: the disk fills as the spill writes
    text = "head " + "x" * (spill.MAX_CHARS + 10) + " tail"
    report = pytest.TestReport("t.py::t", ("t.py", 0, "t"), {}, "failed", text, "call")
    spill.spill_report(report, tmp_path / "spilled")
    kept = str(report.longrepr)
    assert kept.startswith("head ") and kept.endswith(" tail")
    assert f"the whole text could not be written to {tmp_path / 'spilled'}" in kept
    assert "No space left on device" in kept
    assert len(kept) < 3 * spill.KEPT_CHARS
