"""Marked tests under pytest's selection and distribution: xdist, -x, -k, --lf."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.error_bounds import INTERRUPT_BOUND_S, note_elapsed
from tests.plugin._inner import InnerProject, leftover_processes

MARKED_FILE = """
import pytest
import torch
import torch.distributed as dist

from rankrec import record


@pytest.mark.fsdp2
def test_marked_a():
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
    record("marked")


@pytest.mark.fsdp2
def test_marked_b():
    record("marked")


def test_unmarked():
    record("unmarked")
"""


WORKER_DEATH = f"""
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from rankrec import RECORDS, record


def parent_of(pid):
    with open(f"/proc/{{pid}}/stat") as f:
        return int(f.read().rsplit(")", 1)[-1].split()[1])


def alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.fsdp2
def test_worker_killed_while_its_ranks_run(fsdp2_rank):
    launcher = os.getppid()  # torchrun, started by the xdist worker's controller
    record("doomed", launcher=launcher, at=time.time())
    dist.barrier()
    if fsdp2_rank == 0:
        os.kill(parent_of(launcher), signal.SIGKILL)
    dist.barrier()  # never completes: only the ranks' watchdog can end them
    while True:
        time.sleep(0.1)


def test_the_dead_workers_ranks_end():
    # Runs in the other worker, or in the one that replaces the dead worker.
    deadline = time.monotonic() + 300  # until both ranks are in the doomed test
    while len(list(RECORDS.glob("doomed.*"))) < 2:
        assert time.monotonic() < deadline, "the doomed test never started"
        time.sleep(0.1)
    doomed = [json.loads(p.read_text()) for p in RECORDS.glob("doomed.*")]
    pids = {{d["pid"] for d in doomed}} | {{d["launcher"] for d in doomed}}
    killed_at = max(d["at"] for d in doomed)
    while any(alive(pid) for pid in pids):
        assert time.time() - killed_at < {INTERRUPT_BOUND_S}, "ranks outlived their worker"
        time.sleep(0.1)
    record("gone", seconds=time.time() - killed_at)


@pytest.mark.fsdp2
def test_marked_test_of_a_live_worker_passes():
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
    record("marked")
"""


@pytest.fixture(scope="module")
def xdist_session(
    module_inner: InnerProject,
) -> Iterator[tuple[InnerProject, Future[pytest.RunResult]]]:
    """The ``-n 2`` inner session, started when this module starts: it runs while the -x/--lf
    sessions below run (each mostly waits for its ranks to start)."""
    module_inner.write(test_one=MARKED_FILE, test_two=MARKED_FILE, test_worker_death=WORKER_DEATH)
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield module_inner, pool.submit(module_inner.run, "-n", "2", "-rA")


@pytest.mark.usefixtures("xdist_session")  # started first, so that it runs beside this test
def test_exitfirst_keyword_and_last_failed(inner: InnerProject) -> None:
    inner.write(
        test_select="""
        import pytest
        from rankrec import record

        pytestmark = pytest.mark.fsdp2

        def test_a_passes():
            record("ran", test="a")

        def test_b_fails():
            record("ran", test="b")
            assert False

        def test_c_not_reached():
            record("ran", test="c")

        def test_deselected():
            record("ran", test="deselected")
        """
    )
    first = inner.run("-x", "-k", "not deselected", cache=True)
    first.assert_outcomes(passed=1, failed=1)
    # test_b_fails is sent ahead as soon as test_a_passes passed (runner/predispatch.py); its
    # failure must stop the session before test_c_not_reached reaches the ranks.
    first.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    assert sorted(r["test"] for r in inner.records("ran")) == ["a", "a", "b", "b"]

    lastfailed = json.loads((inner.path / ".pytest_cache/v/cache/lastfailed").read_text())
    assert lastfailed == {"test_select.py::test_b_fails": True}, "the ranks wrote the cache?"

    second = inner.run("--lf", cache=True)
    second.assert_outcomes(failed=1)
    assert sorted(r["test"] for r in inner.records("ran")) == ["a", "a", "b", "b", "b", "b"]
    assert leftover_processes(inner.tag) == []


def test_xdist_workers_get_their_own_ranks_and_a_killed_worker_is_reported(
    xdist_session: tuple[InnerProject, Future[pytest.RunResult]],
) -> None:
    """One ``-n 2`` session: two plain files and one whose test kills its own xdist worker.

    Every worker that ran marked tests had ranks of its own (two pids, shared with no other
    worker; the dead worker's replacement gets new ones); the dead worker's test is reported as
    a crash, its ranks end within the bound, and nothing is left running.
    """
    inner, running = xdist_session
    result = running.result()
    result.assert_outcomes(passed=8, failed=1)
    marked = inner.records("marked")
    assert len(marked) == 10  # 5 marked tests that record, x 2 ranks
    workers: dict[str, set[int]] = {}
    for record in marked:
        workers.setdefault(record["worker"], set()).add(record["pid"])
    assert len(workers) >= 2, workers
    assert all(len(pids) == 2 for pids in workers.values()), workers
    every_pid = [pid for pids in workers.values() for pid in pids]
    assert len(every_pid) == len(set(every_pid)), f"workers shared ranks: {workers}"
    assert {r["rank"] for r in inner.records("unmarked")} == {"parent"}
    result.stdout.fnmatch_lines(
        [
            "*worker 'gw?' crashed while running "
            "'test_worker_death.py::test_worker_killed_while_its_ranks_run'*",
        ]
    )
    result.stdout.fnmatch_lines(["*replacing crashed worker gw?*"])
    (gone,) = inner.records("gone")
    assert gone["seconds"] < INTERRUPT_BOUND_S
    note_elapsed(gone["seconds"])
    assert leftover_processes(inner.tag) == []
