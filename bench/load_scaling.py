"""Two arms of ``bench_load.py`` that are not loaders: the transport's ceiling and memory scaling.

* ``scatter``: a raw gloo ``scatter`` of the checkpoint's bytes, in the same run as the loaders.
  Rank 0 holds the bytes in one touched buffer (as the checkpoint is in memory), every rank
  receives its share into a buffer allocated inside the timed region (as a loader fills shards
  whose pages are first touched by the load), cut into the same number of scatters as the
  loader's tensors would be by the loader's own bucket size. It is the physical ceiling of a
  scatter-based loader on this transport: every byte crosses once, nothing is packed or checked.
* memory scaling: fp32keep loading an FP32 checkpoint into a bf16 model (every tensor converted,
  the case where the source rank must make copies) at 2, 4 and 8 ranks with small buckets; the
  source rank's peak rise minus the shard bytes it writes for itself is the loader's own extra
  memory, which must not grow with the world size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from _common import Table, Target, fmt, proc_status_kib, reset_peak_rss

MIB = 2**20

MEMORY_CONFIG: dict[str, int] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 16000,
}
"""~80M parameters (320 MB FP32): 8 ranks of it fit in a few GiB."""

MEMORY_RANKS = (2, 4, 8)
MEMORY_BUCKET_MIB = 16

MEMORY_NOTES = (
    "Ceiling: the faster scatter arm; rank 0's bytes are in one touched buffer, each rank "
    "receives into memory allocated inside the timed region, as the loader's shards are.",
    "Memory arms: by design the source rank holds at most bucket_bytes of converted copies in "
    "flight plus the tensor being converted (direct scatters), then one bucket of bucket_bytes "
    "summed over every destination: 2 x 16 MiB + the largest converted tensor (31 MiB), "
    "whatever the world size. VmHWM also counts allocator slack (freed memory not yet returned "
    "to the kernel), which moves by tens of MiB from run to run; one run per world size.",
)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim(0)``), where available.

    Called before every timed load and scatter, so that every one receives into pages it touches
    first, as a fresh process does: without it a repeat in the same process can reuse pages that
    an earlier load touched and then freed (glibc keeps tensors below its adaptive mmap threshold
    in the heap), which would flatter the loaders against the ceiling (its 0.7 GB buffer is
    always a fresh mapping). A precaution: how much it changes the figures is not measured.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


def scatter_ceiling(total_bytes: int, chunk_bytes: int, repeats: int) -> tuple[list[float], int]:
    """Seconds for raw scatters of ``total_bytes`` from rank 0 (the slowest rank's), per repeat,
    and rank 0's peak rise in KiB on the first one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = total_bytes // world
    source = torch.ones(world * share, dtype=torch.uint8) if rank == 0 else None
    pieces = max(1, -(-share // chunk_bytes))
    seconds: list[float] = []
    peak_kib = 0
    for repeat in range(repeats):
        return_freed_memory()
        dist.barrier()
        reset_peak_rss()
        before = proc_status_kib("VmRSS")
        start = time.perf_counter()
        received = torch.empty(share, dtype=torch.uint8)  # first touched by the scatter
        works = []
        for piece in range(pieces):
            lo, hi = piece * share // pieces, (piece + 1) * share // pieces
            inputs = None
            if source is not None:
                inputs = [source[r * share + lo : r * share + hi] for r in range(world)]
            works.append(dist.scatter(received[lo:hi], inputs, src=0, async_op=True))
        for work in works:
            assert work is not None
            work.wait()
        elapsed = time.perf_counter() - start
        if repeat == 0:
            peak_kib = proc_status_kib("VmHWM") - before
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds.append(float(slowest.item()))
        del received
    return seconds, peak_kib


def own_shard_bytes(model: Any) -> int:
    """Bytes of every local shard and buffer this rank holds (what its own load must write)."""
    total = 0
    for value in model.state_dict().values():
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return int(total)


def memory_table(measured: Mapping[int, Mapping[str, Any]], nbytes: int) -> Table:
    table = Table(
        f"fp32keep, FP32 checkpoint into a bf16 Llama ({nbytes / 1e6:.0f} MB FP32; every tensor "
        f"converted on the source rank), {MEMORY_BUCKET_MIB} MiB buckets; rank 0's first load "
        "in a fresh process.",
        [
            "ranks",
            "rank 0 peak +MiB",
            "its own shards MiB",
            "loader's extra MiB (peak - own shards)",
            "largest rank != 0 peak +MiB",
            "shards",
        ],
    )
    for ranks, data in sorted(measured.items()):
        table.rows.append(
            [
                str(ranks),
                fmt(data["peak_mib"]),
                fmt(data["own_mib"]),
                fmt(data["peak_mib"] - data["own_mib"]),
                fmt(data["others_mib"]),
                "as cut from the checkpoint" if data["exact"] else "DIFFERENT",
            ]
        )
    return table


def memory_targets(measured: Mapping[int, Mapping[str, Any]], largest_mib: float) -> list[Target]:
    """Extra memory at the largest world within 25% (+ 8 MiB of allocator noise) of the smallest,
    and under two buckets plus the largest converted tensor."""
    extra = {ranks: d["peak_mib"] - d["own_mib"] for ranks, d in measured.items()}
    small, large = min(extra), max(extra)
    bound = 2 * MEMORY_BUCKET_MIB + largest_mib
    return [
        Target(
            f"memory: source rank's extra at {large} ranks vs {small} ranks",
            f"{extra[large]:.0f} MiB vs {extra[small]:.0f} MiB",
            extra[large] <= 1.25 * extra[small] + 8,
            "<= 1.25x + 8 MiB",
        ),
        Target(
            "memory: source rank's extra at every world size vs 2 buckets + largest tensor",
            f"{max(extra.values()):.0f} MiB vs {bound:.0f} MiB",
            max(extra.values()) <= bound,
            "<=",
        ),
        Target(
            "shards: memory arms equal to the checkpoint's chunks",
            "identical" if all(d["exact"] for d in measured.values()) else "DIFFERENT",
            all(d["exact"] for d in measured.values()),
            "identical",
        ),
    ]


def ceiling_targets(
    fp32keep_s: float, dcp_s: float, ceiling_s: float, label: str
) -> Sequence[Target]:
    return [
        Target(
            f"speed: {label} vs dcp",
            f"{dcp_s / fp32keep_s:.2f}x",
            dcp_s / fp32keep_s >= 2.0,
            ">= 2x",
        ),
        Target(
            f"speed: {label} vs the raw gloo scatter of the same bytes (ceiling time / ours)",
            f"{100 * ceiling_s / fp32keep_s:.0f} %",
            ceiling_s / fp32keep_s >= 0.9,
            ">= 90 %",
        ),
    ]
