"""Helpers for driving real inner pytest sessions (pytester) with real torchrun ranks.

Every inner session runs with a unique ``FP32KEEP_TEST_TAG`` in its environment; torchrun and
the ranks inherit it, so ``/proc`` tells which processes an inner session left behind, without
psutil and without guessing by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TAG_VARIABLE = "FP32KEEP_TEST_TAG"
#: Bound on one inner session: a bug in the engine must fail a test, not hang CI.
INNER_TIMEOUT_S = 600.0

#: Written into every inner project: bodies call ``record(name, **data)`` to leave evidence
#: of where they ran (pid, rank, xdist worker) that the outer test reads back.
RECORDER = """
import json, os
from pathlib import Path

RECORDS = Path(__file__).parent / "records"


def record(name, **data):
    RECORDS.mkdir(exist_ok=True)
    rank = os.environ.get("RANK", "parent")
    data.update(pid=os.getpid(), rank=rank, worker=os.environ.get("PYTEST_XDIST_WORKER"))
    path = RECORDS / f"{name}.{rank}.{os.getpid()}.{len(list(RECORDS.iterdir()))}.json"
    path.write_text(json.dumps(data))
"""

#: The smallest real marked test: one collective in every rank.
PASSING_MARKED_TEST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.fsdp2
def test_collective():
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
"""

#: An inner conftest that records, in the pytest process only, each test's wall time: from the
#: moment its ranks may have started it to its ``logfinish``. That is its ``logstart``, or earlier
#: when the test before it passed: the plugin then sends the next test to the ranks before it logs
#: the passed one (pre-dispatch), so from the passed test's first report on.
WALL_CLOCK_CONFTEST = """
import json, os, time
from pathlib import Path

_started = {}
_previous_reported = []


def pytest_runtest_logstart(nodeid, location):
    if "RANK" not in os.environ:
        _started[nodeid] = min([time.monotonic(), *_previous_reported])
        _previous_reported.clear()


def pytest_runtest_logreport(report):
    if "RANK" not in os.environ and report.when == "setup":
        _previous_reported.append(time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    if "RANK" not in os.environ:
        path = Path(__file__).parent / "wall.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[nodeid] = time.monotonic() - _started[nodeid]
        path.write_text(json.dumps(data))
"""


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose environment carries ``tag``: (pid, command line)."""
    marker = f"{TAG_VARIABLE}={tag}".encode()
    found: list[tuple[int, str]] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if marker not in f.read():
                    continue
            with open(f"/proc/{entry.name}/stat", encoding="utf-8") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append((int(entry.name), command))
    return found


def leftover_processes(tag: str, wait_s: float = 15.0) -> list[tuple[int, str]]:
    """Processes of an inner session still alive after ``wait_s`` (killed ones need a moment
    to be reaped by whoever inherits them)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = tagged_processes(tag)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def failure_section(output: str, test_name: str) -> str:
    """The text of ``test_name``'s block in the FAILURES/ERRORS part of pytest's output."""
    lines = output.splitlines()
    header = re.compile(rf"^_+ (ERROR at \w+ of )?{re.escape(test_name)} _+$")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    assert start is not None, f"no failure section for {test_name} in:\n{output}"
    end = start + 1
    while end < len(lines) and not re.match(r"^(_{3,} .* _{3,}|={3,} .* ={3,})$", lines[end]):
        end += 1
    return "\n".join(lines[start:end])


class InnerProject:
    """An inner pytest project: files, a process tag, a records folder, a way to run it.

    With a ``pytester`` (function-scoped tests) runs go through
    ``pytester.runpytest_subprocess``. Without one (a module-scoped project shared by several
    checks of one expensive session) runs go through the same kind of subprocess, built here,
    and come back as the same ``pytest.RunResult``.
    """

    def __init__(self, path: Path, tag: str, pytester: pytest.Pytester | None = None) -> None:
        self.path = path
        self.tag = tag
        self.pytester = pytester
        self._runs = 0
        self.write(rankrec=RECORDER)

    def write(self, **files: str) -> None:
        """Write ``name=source`` pairs as ``name.py`` (sources are dedented)."""
        for name, source in files.items():
            (self.path / f"{name}.py").write_text(textwrap.dedent(source))

    def run(
        self, *args: str, timeout: float = INNER_TIMEOUT_S, cache: bool = False
    ) -> pytest.RunResult:
        """Run pytest in a subprocess (the real entry point, a fresh interpreter).

        The cache provider is off unless ``cache`` (``--lf`` needs it).
        """
        no_cache = () if cache else ("-p", "no:cacheprovider")
        if self.pytester is not None:
            return self.pytester.runpytest_subprocess(*no_cache, *args, timeout=timeout)
        self._runs += 1
        command = [
            sys.executable,
            "-m",
            "pytest",
            f"--basetemp={self.path / f'runpytest-{self._runs}'}",
            *no_cache,
            *args,
        ]
        env = {**os.environ, TAG_VARIABLE: self.tag}
        env.pop("PYTEST_ADDOPTS", None)
        start = time.monotonic()
        completed = subprocess.run(
            command, cwd=self.path, env=env, capture_output=True, text=True, timeout=timeout
        )
        print(completed.stdout)  # shown by the outer pytest when a check fails
        print(completed.stderr, file=sys.stderr)
        return pytest.RunResult(
            completed.returncode,
            completed.stdout.splitlines(),
            completed.stderr.splitlines(),
            time.monotonic() - start,
        )

    def records(self, name: str) -> list[dict[str, Any]]:
        """What bodies recorded under ``name``, ordered by rank."""
        folder = self.path / "records"
        found = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{name}.*.json"))]
        return sorted(found, key=lambda r: str(r["rank"]))

    def wall_times(self) -> dict[str, float]:
        """Wall time per node id measured in the pytest process (needs WALL_CLOCK_CONFTEST)."""
        data: dict[str, float] = json.loads((self.path / "wall.json").read_text())
        return data

    def kill_leftovers(self) -> None:
        """Safety net after the assertions: leave nothing of this project running."""
        for pid, _ in tagged_processes(self.tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def new_tag() -> str:
    """A tag no other session uses."""
    return uuid.uuid4().hex


@contextlib.contextmanager
def tagged_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> Iterator[InnerProject]:
    """An inner project (pytester) whose pytest, torchrun and ranks carry a unique tag; every
    process still carrying it is killed afterwards (the ``inner`` fixtures)."""
    tag = new_tag()
    monkeypatch.setenv(TAG_VARIABLE, tag)
    project = InnerProject(pytester.path, tag, pytester)
    try:
        yield project
    finally:
        project.kill_leftovers()
