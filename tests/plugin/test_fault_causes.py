"""Faults whose cause the report must name, within seconds: a stopped rank, the kernel's OOM
killer (and a plain SIGKILL that is not one).

One inner session with ``--fsdp-timeout=60``: a verdict within :data:`RANK_FAULT_BOUND_S` (30 s)
was reached by naming the cause, not by the timeout. Each fault is followed by a passing test
that must get fresh ranks. The OOM case needs a memory cgroup this process may create (root, a
writable cgroup file system): rank 1 of every group moves itself into a child cgroup with a
memory limit at start-up (the inner conftest), and the test allocates past it, so that the kernel
itself kills it. Where that is not permitted the OOM case is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_fp32keep.runner import oom
from pytest_fp32keep.runner.stopped import STOPPED_GRACE_S, StoppedWatch
from tests.error_bounds import RANK_FAULT_BOUND_S, note_elapsed
from tests.plugin._inner import (
    WALL_CLOCK_CONFTEST,
    InnerProject,
    failure_section,
    leftover_processes,
    new_tag,
)

#: The inner session's timeout: far above the bound, so a verdict in time named its cause.
FSDP_TIMEOUT_S = 60
#: Where rank 1 of every inner group makes its limited memory cgroup (set only when permitted).
CONFINE_VARIABLE = "FP32KEEP_TEST_OOM_CGROUP"

#: In every inner rank: rank 1 confines itself to a child memory cgroup of ``$CONFINE_VARIABLE``
#: (1 GiB, no swap) before the controller first reads the ranks' cgroups.
CONFTEST = (
    WALL_CLOCK_CONFTEST
    + """
import os
from pathlib import Path

_parent = os.environ.get("FP32KEEP_TEST_OOM_CGROUP")
if _parent and os.environ.get("RANK") == "1":
    child = Path(_parent) / f"fp32keep-oom-test-{os.getpid()}"
    child.mkdir()
    limit = str(1 << 30)
    if (child / "memory.max").exists():  # cgroup v2
        (child / "memory.max").write_text(limit)
        (child / "memory.swap.max").write_text("0")
    else:  # cgroup v1
        (child / "memory.limit_in_bytes").write_text(limit)
        if (child / "memory.memsw.limit_in_bytes").exists():
            (child / "memory.memsw.limit_in_bytes").write_text(limit)
    (child / "cgroup.procs").write_text(str(os.getpid()))
"""
)

TESTS = """
import os
import signal

import pytest
import torch
import torch.distributed as dist

from rankrec import record

pytestmark = pytest.mark.fsdp2


def ok(name):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
    record("ok", test=name)


def test_ok_first():
    ok("first")


def test_stopped_rank(fsdp2_rank):
    if fsdp2_rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))


def test_ok_after_stop():
    ok("after_stop")


def test_plain_sigkill(fsdp2_rank):
    if fsdp2_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_ok_after_sigkill():
    ok("after_sigkill")
"""

OOM_TESTS = """

def test_killed_by_the_oom_killer(fsdp2_rank):
    if fsdp2_rank == 1:
        hoard = b"x" * (4 << 30)  # 4 GiB written, in a cgroup of 1 GiB: the kernel kills it
        print(len(hoard))
    dist.all_reduce(torch.ones(1))


def test_ok_after_oom():
    ok("after_oom")
"""


def own_memory_cgroup() -> Path | None:
    """This process's memory cgroup folder, where its ``oom_kill`` counter lives."""
    counter = oom.counter_file(os.getpid())
    return counter.parent if counter is not None else None


def confinement_refused() -> str | None:
    """Why the OOM case cannot run here (no root, no writable memory cgroup), or ``None``."""
    if os.geteuid() != 0:
        return "needs root to make a memory cgroup with a limit"
    folder = own_memory_cgroup()
    if folder is None:
        return "no memory cgroup counter (memory.events / memory.oom_control) is readable"
    probe = folder / f"fp32keep-oom-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot make a child memory cgroup in {folder}: {exc}"
    probe.rmdir()
    return None


class Session:
    """The inner session's result."""

    def __init__(self, project: InnerProject, result: pytest.RunResult, oom_refused: str | None):
        self.project = project
        self.result = result
        self.oom_refused = oom_refused

    def section(self, test: str) -> str:
        return failure_section(self.result.stdout.str(), test)

    def within_bound(self, test: str) -> float:
        wall = self.project.wall_times()[f"test_fault_causes.py::{test}"]
        assert wall < RANK_FAULT_BOUND_S, f"{test} took {wall:.1f} s (bound {RANK_FAULT_BOUND_S})"
        note_elapsed(wall)
        return wall


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    refused = confinement_refused()
    project = InnerProject(tmp_path_factory.mktemp("causes"), new_tag())
    project.write(test_fault_causes=TESTS + ("" if refused else OOM_TESTS), conftest=CONFTEST)
    folder = own_memory_cgroup()
    environ = {CONFINE_VARIABLE: str(folder)} if refused is None and folder else {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        result = project.run("-rA", f"--fsdp-timeout={FSDP_TIMEOUT_S}")
    yield Session(project, result, refused)
    project.kill_leftovers()
    if folder is not None:
        for child in folder.glob("fp32keep-oom-test-*"):
            with contextlib.suppress(OSError):
                child.rmdir()  # empty once its rank is gone


def test_every_fault_fails_and_the_next_test_gets_fresh_ranks(session: Session) -> None:
    faults = 2 if session.oom_refused else 3
    session.result.assert_outcomes(passed=faults + 1, failed=faults)
    pids = {r["test"]: r["pid"] for r in session.project.records("ok") if r["rank"] == "1"}
    assert len(pids) == faults + 1 and len(set(pids.values())) == faults + 1, pids


def test_a_stopped_rank_is_named_within_seconds(session: Session) -> None:
    text = session.section("test_stopped_rank")
    assert "root cause: rank 1 (first to fail)" in text, text
    assert (
        f"was stopped by a signal (SIGSTOP: process state T) for {STOPPED_GRACE_S:g} s "
        "while running the test; killed"
    ) in text
    assert "was killed with rank 1, which was stopped" in text  # rank 0, in its all_reduce
    assert "in all_reduce" in text  # rank 0's stack
    session.within_bound("test_stopped_rank")


def test_a_plain_sigkill_is_not_called_out_of_memory(session: Session) -> None:
    # The negative control of the OOM verdict: a SIGKILL without the cgroup's evidence.
    text = session.section("test_plain_sigkill")
    assert "killed by signal 9 (SIGKILL) while running the test" in text
    assert "out-of-memory" not in text
    session.within_bound("test_plain_sigkill")


def test_the_kernels_oom_kill_is_named(session: Session) -> None:
    if session.oom_refused:
        pytest.skip(f"no real OOM kill here: {session.oom_refused}")
    text = session.section("test_killed_by_the_oom_killer")
    assert "root cause: rank 1 (first to fail)" in text
    assert (
        "killed by signal 9 (SIGKILL) while running the test, by the kernel's out-of-memory "
        "killer (the oom_kill count of the rank's memory cgroup"
    ) in text, text
    assert "rose from 0 to 1 during the test" in text
    session.within_bound("test_killed_by_the_oom_killer")


def test_no_process_left(session: Session) -> None:
    assert leftover_processes(session.project.tag) == []


# --- the verdicts' own rules, without ranks ----------------------------------------------------


def test_a_rank_is_named_stopped_only_after_the_grace_in_state_t() -> None:
    states = {101: "S", 102: "T"}
    watch = StoppedWatch({0: 101, 1: 102}, started=0.0, state=states.get)
    assert watch.stopped([0, 1], now=0.1) == {}  # before the first sample is due
    assert watch.stopped([0, 1], now=0.5) == {}  # seen stopped, the grace starts
    assert watch.stopped([0, 1], now=0.5 + STOPPED_GRACE_S - 0.1) == {}
    found = watch.stopped([0, 1], now=0.5 + STOPPED_GRACE_S + 0.5)
    assert list(found) == [1] and "SIGSTOP" in found[1]


def test_a_rank_that_resumes_within_the_grace_is_not_named() -> None:
    # Negative control: a brief stop (a sampling profiler's attach) starts the grace over.
    states = {102: "t"}
    watch = StoppedWatch({1: 102}, started=0.0, state=states.get)
    assert watch.stopped([1], now=0.5) == {}
    states[102] = "R"
    assert watch.stopped([1], now=1.5) == {}
    states[102] = "t"
    assert watch.stopped([1], now=2.0) == {}
    assert watch.stopped([1], now=2.0 + STOPPED_GRACE_S - 0.1) == {}
    assert "tracer" in watch.stopped([1], now=2.0 + STOPPED_GRACE_S + 0.5)[1]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("memory.events", "low 0\nhigh 0\nmax 3\noom 2\noom_kill {}\noom_group_kill 0\n"),
        ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n"),
    ],
)
def test_only_a_rise_of_the_oom_kill_counter_is_the_oom_killer(
    tmp_path: Path, name: str, text: str
) -> None:
    counter = tmp_path / name
    counter.write_text(text.format(4))
    before = oom.read_counts([counter])
    assert before == {counter: 4}
    assert oom.oom_killed(counter, before) is None  # unchanged: a plain SIGKILL
    assert oom.oom_killed(None, before) is None  # no counter for that rank
    counter.write_text(text.format(5))
    said = oom.oom_killed(counter, before)
    assert said is not None and f"{counter}, rose from 4 to 5" in said


def test_the_counter_file_is_found_from_the_process_cgroup(tmp_path: Path) -> None:
    lines = Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines()
    v1 = next((line for line in lines if "memory" in line.split(":")[1].split(",")), None)
    if v1 is not None:
        relative = v1.split(":", 2)[2].lstrip("/")
        expected = tmp_path / "memory" / relative / "memory.oom_control"
    else:
        relative = next(line for line in lines if line.startswith("0::")).split(":", 2)[2]
        expected = tmp_path / relative.lstrip("/") / "memory.events"
    assert oom.counter_file(os.getpid(), root=tmp_path) is None  # nothing mounted there
    expected.parent.mkdir(parents=True, exist_ok=True)
    expected.write_text("oom_kill 0\n")
    assert oom.counter_file(os.getpid(), root=tmp_path) == expected
