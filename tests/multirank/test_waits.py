"""What a rank says its main thread is blocked in (``runner/waits.py``), seen in real ranks.

Each check makes rank 1 wait in a real collective that rank 0 joins :data:`LATE_S` late, while
a thread of each rank samples the main thread as the rank session's watch does. Rank 0 sleeps
meanwhile, in its own code: its samples are the negative control (a sleeping rank is not
blocked in communication, which the CPU-time rule before issue 22 could not tell). Nothing is
left stuck: every collective completes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from pytest_fp32keep.runner.waits import WATCH_POLL_S, Blocked, BlockedSampler

pytestmark = pytest.mark.fsdp2(nproc=2)

#: How late rank 0 joins: several samples of rank 1 blocked.
LATE_S = 1.5


def _samples_while(run: Callable[[Callable[[str], None]], None]) -> list[tuple[str, Blocked]]:
    """Run ``run(phase)`` on this (the main) thread while another thread samples it; the
    samples that found it blocked, labelled with the phase ``run`` had announced."""
    sampler = BlockedSampler(threading.get_ident())
    started = time.time()
    phase = ["start"]
    found: list[tuple[str, Blocked]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCH_POLL_S):
            blocked = sampler.sample(issued_since=started)
            if blocked is not None:
                found.append((phase[0], blocked))

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        run(lambda name: phase.__setitem__(0, name))
    finally:
        stop.set()
        thread.join()
    return found


def _late_on_rank_0(rank: int) -> None:
    if rank == 0:
        time.sleep(LATE_S)


def test_a_blocking_collective_is_seen_as_torch_distributed(fsdp2_rank: int) -> None:
    def run(_: Callable[[str], None]) -> None:
        _late_on_rank_0(fsdp2_rank)
        dist.all_reduce(torch.ones(1))

    found = _samples_while(run)
    if fsdp2_rank == 1:
        wheres = [blocked.where for _, blocked in found]
        in_c10d = "all_reduce (torch/distributed/distributed_c10d.py:"
        assert any(where.startswith(in_c10d) for where in wheres), wheres
        assert all(blocked.group_ranks is None for _, blocked in found)  # not known from a frame
    else:
        assert found == []  # asleep in its own code, not blocked in communication


def test_async_work_waited_on_in_the_tests_own_code_is_seen_by_the_flight_recorder(
    fsdp2_rank: int,
) -> None:
    def run(phase: Callable[[str], None]) -> None:
        phase("wait")
        _late_on_rank_0(fsdp2_rank)
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()  # a frame of this test, not torch.distributed's
        phase("after")
        time.sleep(4 * WATCH_POLL_S)  # the collective completed: its own code again

    found = _samples_while(run)
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

    def run(phase: Callable[[str], None]) -> None:
        _late_on_rank_0(fsdp2_rank)
        phase("forward")
        loss = model(torch.ones(2, 8)).sum()
        _late_on_rank_0(fsdp2_rank)
        phase("backward")
        loss.backward()

    found = _samples_while(run)
    if fsdp2_rank == 1:
        for step in ("forward", "backward"):
            wheres = [blocked.where for phase, blocked in found if phase == step]
            assert any("(torch/distributed/" in where for where in wheres), (step, found)
    else:
        assert [phase for phase, _ in found if phase in ("forward", "backward")] == [], found
