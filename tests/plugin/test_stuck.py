"""The controller's "stuck" judgement after a rank left a test (``runner/stuck.py``), pure.

What the ranks report is made up here (``Blocked``: what the main thread is blocked in, since
when, the collective's ranks); tests/multirank/test_waits.py shows real ranks reporting it and
tests/plugin/test_faults.py the whole path, stuck and idle peers alike.
"""

from __future__ import annotations

import json
import subprocess

from pytest_fp32keep.runner.stuck import (
    FAILURE_GRACE_S,
    CpuProgress,
    Departure,
    judge_blocked,
)
from pytest_fp32keep.runner.waits import Blocked, _Recorder, flight_recorder_environment

ALL_REDUCE = "gloo:all_reduce (collective #7 of process group '0')"
RECV = "recv (torch/distributed/distributed_c10d.py:2700)"
T0 = 1000.0  # when rank 0 left (time.time())
FINISHED = {0: Departure(T0, "finished")}


def test_a_collective_with_a_rank_that_left_is_stuck_after_the_grace() -> None:
    blocked = {1: Blocked(T0 - 5, ALL_REDUCE, (0, 1, 2))}
    # rank 2 runs its own code (it would still join): rank 1's collective holds rank 0, gone
    assert judge_blocked([1, 2], blocked, FINISHED, T0 + FAILURE_GRACE_S - 0.1) is None
    verdict = judge_blocked([1, 2], blocked, FINISHED, T0 + FAILURE_GRACE_S)
    assert verdict is not None
    assert verdict[1].blocked and verdict[1].reason == (
        f"it was blocked in {ALL_REDUCE}, a collective of ranks 0,1,2 that rank 0 never joins"
    )
    assert not verdict[2].blocked  # killed with it, not blocked itself
    assert verdict[2].reason == "it was running its own code when rank 1 was found stuck"


def test_the_grace_counts_from_the_later_of_the_departure_and_the_wait() -> None:
    blocked = {1: Blocked(T0 + 4, ALL_REDUCE, (0, 1))}  # its own code for 4 s, then blocked
    assert judge_blocked([1], blocked, FINISHED, T0 + 4 + FAILURE_GRACE_S - 0.1) is None
    verdict = judge_blocked([1], blocked, FINISHED, T0 + 4 + FAILURE_GRACE_S)
    assert verdict is not None and verdict[1].own_code_for == 4


def test_a_rank_in_its_own_code_is_waited_for_however_long() -> None:
    # nothing reported: sleeping, waiting on a child process, computing
    assert judge_blocked([1], {}, FINISHED, T0 + 3600) is None


def test_a_collective_among_ranks_still_running_waits_for_them() -> None:
    blocked = {1: Blocked(T0, ALL_REDUCE, (1, 2))}  # rank 2 may still join it
    assert judge_blocked([1, 2], blocked, FINISHED, T0 + 3600) is None


def test_blocked_where_the_group_is_unknown_is_stuck_once_every_running_rank_is() -> None:
    one = {1: Blocked(T0, RECV)}
    assert judge_blocked([1, 2], one, FINISHED, T0 + 60) is None  # rank 2 may still send
    both = {1: Blocked(T0, RECV), 2: Blocked(T0 + 1, RECV)}
    assert judge_blocked([1, 2], both, FINISHED, T0 + 1 + FAILURE_GRACE_S - 0.1) is None
    verdict = judge_blocked([1, 2], both, FINISHED, T0 + 1 + FAILURE_GRACE_S)
    assert verdict is not None
    assert (
        verdict[2].reason
        == f"it was blocked in {RECV}, as was every rank still running (ranks 1,2)"
    )
    alone = judge_blocked([1], one, FINISHED, T0 + FAILURE_GRACE_S)
    assert alone is not None
    assert alone[1].reason == (
        f"it was blocked in {RECV}, and no other rank was left running to unblock it"
    )


def test_nothing_is_stuck_before_a_rank_left() -> None:
    assert judge_blocked([0, 1], {1: Blocked(T0, RECV)}, {}, T0 + 3600) is None


def test_negative_control_the_cpu_rule_kills_a_sleeping_rank_after_the_grace() -> None:
    # The rule before issue 22, kept only for ranks that cannot report: a process that sleeps
    # uses no CPU, so it counts as stuck FAILURE_GRACE_S after the peer left.
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        progress = CpuProgress({1: sleeper.pid})
        progress.sample([1], 0.0)
        assert progress.stuck([1], 0.0, FAILURE_GRACE_S - 0.5) is None
        assert progress.stuck([1], 0.0, FAILURE_GRACE_S) == 0.0
    finally:
        sleeper.kill()
        sleeper.wait()


class _LaggingRecorder:
    """A Flight Recorder dump whose "last completed" stays behind (as gloo's can, torch 2.13)
    while its one entry, the collective the test waited on, goes from pending to retired."""

    def __init__(self) -> None:
        self.retired = False
        self.entry_reads = 0

    def __call__(self, include_collectives: bool, only_active: bool) -> str:
        status = {"0": {"last_enqueued_collective": 7, "last_completed_collective": 6}}
        if not include_collectives:
            return json.dumps({"pg_status": status})
        self.entry_reads += 1
        entry = {
            "time_created_ns": int(T0 * 1e9),
            "retired": self.retired,
            "profiling_name": "gloo:all_reduce",
            "collective_seq_id": 7,
            "process_group": ["0", ""],
        }
        return json.dumps({"pg_status": status, "entries": [entry]})


def test_a_completed_collective_is_not_reported_where_the_thread_stands_next() -> None:
    """The status alone reads the same before and after the wait returned; the sampler asks the
    recorder afresh wherever the thread stands still next, so the sleep after a completed
    ``work.wait()`` is the test's own code, not the finished collective (seen under load:
    tests/multirank/test_waits.py)."""
    dump = _LaggingRecorder()
    recorder = _Recorder()
    recorder._dumps = [dump]
    waiting = recorder.pending(T0 - 1, fresh=True)
    assert waiting is not None and waiting.where.startswith("gloo:all_reduce (collective #7")
    assert recorder.pending(T0 - 1, fresh=False) == waiting  # the same stall: the cheap status
    assert dump.entry_reads == 1
    dump.retired = True  # work.wait() returned; "last completed" still reads 6
    # negative control: asked as if it were the same stall, the recorder repeats its old answer
    assert recorder.pending(T0 - 1, fresh=False) == waiting
    assert recorder.pending(T0 - 1, fresh=True) is None  # somewhere new: read again, retired


def test_the_ranks_get_a_flight_recorder_unless_the_user_sized_it() -> None:
    """torch 2.9 records nothing by default (size 0), torch 2.13 2000 entries: the launcher
    gives the ranks 2000 where neither of torch's size variables is set, and keeps any size the
    user set, under either name (0 switches the recorder, and so the watch, off)."""
    env: dict[str, str] = {"PATH": "/bin"}
    flight_recorder_environment(env)
    assert env == {"PATH": "/bin", "TORCH_FR_BUFFER_SIZE": "2000"}
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        chosen = {name: "0"}
        flight_recorder_environment(chosen)
        assert chosen == {name: "0"}
