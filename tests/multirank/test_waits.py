"""What a rank says its main thread is blocked in (``runner/waits.py``), seen in real ranks.

Each check makes rank 1 wait in a real collective that rank 0 joins late (once rank 1 was seen
blocked: :class:`Phases`), while a thread of each rank samples the main thread as the rank
session's watch does. Rank 0 sleeps meanwhile, in its own code: its samples are the negative
control (a sleeping rank is not blocked in communication, which the CPU-time rule before issue
22 could not tell). Nothing is left stuck: every collective completes.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from pytest_fp32keep.runner.waits import (
    WATCH_POLL_S,
    Blocked,
    BlockedSampler,
    flight_recorder_works,
)

pytestmark = pytest.mark.fsdp2(nproc=2)

#: The longest rank 0 stays late: it joins as soon as rank 1 has been seen blocked in the
#: phase (two samples :data:`WATCH_POLL_S` apart, about half a second on a quiet machine), and
#: after this long without that, so that rank 1's assertion, not a hang, reports it.
LATE_MAX_S = 30.0


class Phases:
    """What ``run`` announces to the sampling thread, and rank 0's lateness.

    Rank 0 joins each collective only once rank 1's sampling thread has seen rank 1 blocked in
    the current phase (a flag file in a directory rank 0 made and broadcast), not after a fixed
    sleep: on a loaded machine a fixed 1.5 s held too few samples (seen under a nox matrix run).
    """

    def __init__(self, rank: int, flags: Path) -> None:
        self.rank = rank
        self.flags = flags
        self.current = "start"

    def enter(self, name: str) -> None:
        self.current = name

    def seen_blocked(self, name: str) -> None:
        (self.flags / name).touch()

    def late(self) -> None:
        """On rank 0: sleep (in this test's own code) until rank 1 was seen blocked."""
        if self.rank != 0:
            return
        deadline = time.monotonic() + LATE_MAX_S
        while not (self.flags / self.current).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _shared_directory(rank: int) -> Path:
    """A directory rank 0 makes, named to every rank (a collective before anything sampled)."""
    made = [tempfile.mkdtemp(prefix="fp32keep-waits-") if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return Path(str(made[0]))


def _samples_while(rank: int, run: Callable[[Phases], None]) -> list[tuple[str, Blocked]]:
    """Run ``run(phases)`` on this (the main) thread while another thread samples it; the
    samples that found it blocked, labelled with the phase ``run`` had announced (a sample
    taken while the phase changed is dropped: it belongs to neither)."""
    phases = Phases(rank, _shared_directory(rank))
    sampler = BlockedSampler(threading.get_ident())
    started = time.time()
    found: list[tuple[str, Blocked]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCH_POLL_S):
            before = phases.current
            blocked = sampler.sample(issued_since=started)
            if blocked is not None and phases.current == before:
                found.append((before, blocked))
                phases.seen_blocked(before)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        run(phases)
    finally:
        stop.set()
        thread.join()
    dist.barrier()  # every rank's thread has stopped writing flags
    if rank == 0:
        shutil.rmtree(phases.flags, ignore_errors=True)
    return found


def test_a_blocking_collective_is_seen_as_torch_distributed(fsdp2_rank: int) -> None:
    def run(phases: Phases) -> None:
        phases.enter("wait")
        phases.late()
        dist.all_reduce(torch.ones(1))

    found = _samples_while(fsdp2_rank, run)
    if fsdp2_rank == 1:
        wheres = [blocked.where for _, blocked in found]
        in_c10d = "all_reduce (torch/distributed/distributed_c10d.py:"
        assert any(where.startswith(in_c10d) for where in wheres), wheres
        assert all(blocked.group_ranks is None for _, blocked in found)  # not known from a frame
    else:
        assert found == []  # asleep in its own code, not blocked in communication


def test_the_flight_recorder_records_the_ranks_collectives(fsdp2_rank: int) -> None:
    """On every torch: torch 2.9's recorder is off unless sized, and the launcher sizes it
    (``flight_recorder_environment``); without that, the check below sees nothing on 2.9."""
    assert flight_recorder_works()


def test_async_work_waited_on_in_the_tests_own_code_is_seen_by_the_flight_recorder(
    fsdp2_rank: int,
) -> None:
    def run(phases: Phases) -> None:
        phases.enter("wait")
        phases.late()
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()  # a frame of this test, not torch.distributed's
        phases.enter("after")
        time.sleep(4 * WATCH_POLL_S)  # the collective completed: its own code again

    found = _samples_while(fsdp2_rank, run)
    if fsdp2_rank == 1:
        in_wait = [blocked for phase, blocked in found if phase == "wait"]
        assert in_wait, found
        assert all(
            blocked.where.startswith(f"{dist.get_backend()}:all_reduce (collective #")
            and blocked.group_ranks == (0, 1)
            for blocked in in_wait
        ), in_wait
        assert [phase for phase, _ in found if phase == "after"] == [], found
    else:
        assert found == []  # asleep before it issued the collective, then never blocked


def test_fsdp2_waiting_on_its_collectives_is_seen_forward_and_backward(
    fsdp2_rank: int, fsdp2_mesh: DeviceMesh
) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=fsdp2_mesh)
    fully_shard(model, mesh=fsdp2_mesh)

    def run(phases: Phases) -> None:
        phases.enter("forward")
        phases.late()
        loss = model(torch.ones(2, 8)).sum()
        phases.enter("backward")
        phases.late()
        loss.backward()

    found = _samples_while(fsdp2_rank, run)
    if fsdp2_rank == 1:
        for step in ("forward", "backward"):
            wheres = [blocked.where for phase, blocked in found if phase == step]
            assert any("(torch/distributed/" in where for where in wheres), (step, found)
    else:
        assert [phase for phase, _ in found if phase in ("forward", "backward")] == [], found
