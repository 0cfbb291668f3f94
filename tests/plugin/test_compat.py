"""Marked tests under pytest's selection and distribution: xdist, -x, -k, --lf."""

from __future__ import annotations

import json

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


def test_xdist_workers_each_get_their_own_ranks(inner: InnerProject) -> None:
    inner.write(test_one=MARKED_FILE, test_two=MARKED_FILE)
    result = inner.run("-n", "2", "--dist=loadfile")
    result.assert_outcomes(passed=6)
    marked = inner.records("marked")
    assert len(marked) == 8  # 4 marked tests x 2 ranks
    workers: dict[str, set[int]] = {}
    for record in marked:
        workers.setdefault(record["worker"], set()).add(record["pid"])
    assert sorted(workers) == ["gw0", "gw1"], workers
    assert all(len(pids) == 2 for pids in workers.values()), workers
    assert not workers["gw0"] & workers["gw1"]
    assert {r["rank"] for r in inner.records("unmarked")} == {"parent"}
    assert leftover_processes(inner.tag) == []


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
    first.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    assert sorted(r["test"] for r in inner.records("ran")) == ["a", "a", "b", "b"]

    lastfailed = json.loads((inner.path / ".pytest_cache/v/cache/lastfailed").read_text())
    assert lastfailed == {"test_select.py::test_b_fails": True}, "the ranks wrote the cache?"

    second = inner.run("--lf", cache=True)
    second.assert_outcomes(failed=1)
    assert sorted(r["test"] for r in inner.records("ran")) == ["a", "a", "b", "b", "b", "b"]
    assert leftover_processes(inner.tag) == []
