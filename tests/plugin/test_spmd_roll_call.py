"""The roll call that names a dead rank of a launched world, over a real c10d TCPStore.

The end-to-end check (rank 2 of two torchrun nodes dies) is in test_spmd.py; these pin the rule
itself: a rank is named only if it never said that it ended, and with its last step.
"""

from __future__ import annotations

import time

import pytest

from pytest_fp32keep.runner.spmd_roll_call import RollCall, describe


@pytest.fixture
def store() -> object:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)


def test_only_the_rank_that_never_ended_is_named_with_its_last_step(store: object) -> None:
    ranks = [RollCall(rank, 4, store) for rank in range(4)]
    for rank, roll in enumerate(ranks):
        roll.doing(f"the call of t.py::test_{rank}")
    ranks[1].ended("stopped by the launcher")
    ranks[3].ended("could not exchange")
    start = time.monotonic()
    silent = ranks[0].silent(grace_s=0.5)
    assert silent == {2: "the call of t.py::test_2"}
    assert time.monotonic() - start >= 0.5  # it waited the grace for rank 2
    text = describe(silent, "torchrun", 0.5)
    assert text.startswith("rank 2 stopped answering during the call of t.py::test_2 (it did")
    assert "in torchrun's log" in text


def test_when_every_rank_ended_none_is_named_and_the_wait_is_short(store: object) -> None:
    # The negative control: the same calls with rank 2's end too name nobody, at once.
    ranks = [RollCall(rank, 4, store) for rank in range(4)]
    for roll in ranks[1:]:
        roll.ended("stopped by the launcher")
    start = time.monotonic()
    assert ranks[0].silent(grace_s=30) == {}
    assert time.monotonic() - start < 5
    assert describe({}, "torchrun") == ""


def test_a_rank_that_never_wrote_a_step_is_still_named(store: object) -> None:
    ranks = [RollCall(rank, 2, store) for rank in range(2)]
    assert describe(ranks[0].silent(grace_s=0.1), "slurm", 0.1).startswith(
        "rank 1 stopped answering (it did not end"
    )


def test_an_earlier_attempt_of_the_launcher_does_not_answer_for_this_one(
    store: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    RollCall(1, 2, store).ended("stopped by the launcher")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert list(RollCall(0, 2, store).silent(grace_s=0.1)) == [1]


def test_a_rank_that_ended_the_run_with_a_cause_is_named_with_it(store: object) -> None:
    ranks = [RollCall(rank, 3, store) for rank in range(3)]
    ranks[1].ended("t.py::test_x destroyed the default process group in its call", cause=True)
    ranks[2].ended("stopped by the launcher")  # negative control: an end without a cause
    assert ranks[0].silent(grace_s=0.1) == {}
    assert ranks[0].causes() == [
        "rank 1: t.py::test_x destroyed the default process group in its call"
    ]
