"""The one test body every dispatch arm runs: a forward and backward of a tiny FSDP2 model.

Imported by the generated test files of ``bench_dispatch.py`` (plugin and PyTorch-harness arms)
and run as a script by its torchrun arm, so the work per test is byte-for-byte the same in every
arm and only the way ranks are started and fed differs:

    torchrun --standalone --nproc-per-node=2 bench/dispatch_body.py INDEX
    torchrun --standalone --nproc-per-node=2 bench/dispatch_body.py --loop COUNT OUT.json

The second form is the floor: the body ``COUNT`` times in one pair of ranks that stay up, with
no test runner at all, each iteration timed from a barrier to a barrier (the slower rank's time).
``OUT.json`` gets ``{"seconds": [...], "cpu": [[rank 0's], [rank 1's]]}``: per iteration the wall
time and each rank's process CPU time (``time.process_time()``, every thread of the rank).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

IN_FEATURES = 32
BATCH = 4


def tiny_fsdp2_step(index: int) -> float:
    """Shard a three-layer MLP (a unit per linear plus the root), run forward and backward.

    ``index`` seeds the weights and the batch, so the 50+ tests differ the way parametrized
    tests do. Returns the loss; raises if a rank's gradients came back missing or not finite.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(index)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, IN_FEATURES),
        nn.ReLU(),
        nn.Linear(IN_FEATURES, IN_FEATURES),
        nn.ReLU(),
        nn.Linear(IN_FEATURES, 8),
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = torch.randn(BATCH, IN_FEATURES)
    loss = model(batch).pow(2).mean()
    loss.backward()
    for name, param in model.named_parameters():
        grad = param.grad
        if not isinstance(grad, DTensor) or not bool(torch.isfinite(grad.full_tensor()).all()):
            raise AssertionError(f"{name}: gradient missing or not finite")
    return float(loss.item())


def body_loop(count: int, first_index: int = 0) -> tuple[list[float], list[float]]:
    """Wall seconds per iteration of the body in ranks that stay up (barrier to barrier), and
    this rank's CPU seconds for each.

    Each iteration is exactly what one test runs, its device mesh included (a test makes its
    own), so that the floor differs from a test only by the runner around it.
    """
    seconds: list[float] = []
    cpu: list[float] = []
    for index in range(first_index, first_index + count):
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        tiny_fsdp2_step(index)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    return seconds, cpu


def main(argv: list[str]) -> int:
    """torchrun entry point: one test, then tear the process group down (as a per-test script
    of verl or accelerate does); or, with ``--loop COUNT OUT``, the floor."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        if argv[:1] == ["--loop"]:
            seconds, cpu = body_loop(int(argv[1]))
            every_cpu: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every_cpu, cpu)
            if dist.get_rank() == 0:
                with open(argv[2], "w", encoding="utf-8") as handle:
                    json.dump({"seconds": seconds, "cpu": every_cpu}, handle)
        else:
            tiny_fsdp2_step(int(argv[0]) if argv else 0)
        gc.collect()  # free FSDP2's reference cycles while the group lives (see rank_session)
        dist.barrier()  # no rank tears down while its peer is still in a collective
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
