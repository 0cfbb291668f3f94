"""Reports of any size: what is too long to travel is written to a file, the report keeps the
head, the tail and the path.

A rank's phase report carries its captured output and its traceback to the controller in one
frame (:mod:`.protocol`). A test that prints hundreds of megabytes, or fails with a huge
assertion message, must still be reported as what it is, quickly, with nothing lost: each
section or traceback longer than :data:`MAX_CHARS` is spilled whole to a file under the rank's
run folder and shortened in the report.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import pytest

from pytest_fp32keep.runner import disk

#: Longest captured section or traceback text a report carries (characters).
MAX_CHARS: Final = 1_000_000
#: How much of a spilled text stays in the report, at each end.
KEPT_CHARS: Final = 20_000


def spill_report(report: pytest.TestReport, folder: Path) -> None:
    """Shorten long sections and the traceback of ``report`` in place; each goes whole to a file."""
    if any(len(content) > MAX_CHARS for _, content in report.sections):
        stem = _stem(report)
        report.sections = [
            (title, _spilled(content, folder / f"{stem}-section{index}.txt"))
            if len(content) > MAX_CHARS
            else (title, content)
            for index, (title, content) in enumerate(report.sections)
        ]
    if report.longrepr is not None:
        text = report.longreprtext
        if len(text) > MAX_CHARS:
            report.longrepr = _spilled(text, folder / f"{_stem(report)}-traceback.txt")


def _stem(report: pytest.TestReport) -> str:
    """The start of a spilled file's name: the test and the phase, safe for any file system."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", report.nodeid)[-120:] + f"-{report.when}"


def _spilled(text: str, path: Path) -> str:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", errors="replace")
        where = f"the whole text is in {path}"
    except OSError as exc:
        # The report must still travel (a lost report fails a test that passed): keep the ends.
        why = disk.full_note(path.parent) or f"{type(exc).__name__}: {exc}"
        where = f"the whole text could not be written to {path}: {why}"
    cut = len(text) - 2 * KEPT_CHARS
    middle = f"... [{cut} characters cut here; {where}] ..."
    return f"{text[:KEPT_CHARS]}\n{middle}\n{text[-KEPT_CHARS:]}"
