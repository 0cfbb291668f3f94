"""PROTOTYPE of a proposed change to ``impl/fp32keep/load.py`` (not the library; delete when the
change lands): scatter large dim-0 shards straight into each rank's local shard.

Measured by ``python bench/bench_load.py --prototype`` as the arm ``proposed: direct scatter``.

What the library does today: every sharded tensor is packed, on the source rank, into one
``torch.zeros`` byte buffer per rank and bucket (a memset plus a copy of every byte), scattered,
and unpacked on every rank with one more copy. Profiling the 1.35 GB Llama on this machine put
most of the source's time in ``torch.zeros`` and ``copy_``, and the receivers waited for it: the
source never overlaps packing with sending.

The proposal keeps the validation protocol untouched (``_agree``, ``_validate`` and the verdict
broadcast are reused as they are) and changes only how bytes move:

* a sharded tensor whose dim 0 splits evenly over the ranks and whose shard is at least
  ``direct_bytes`` travels alone: ``dist.scatter(local_shard, full.chunk(world))``. The inputs
  are views of the checkpoint tensor (no copy unless the dtype differs) and the output is the
  rank's own shard, so no rank allocates anything beyond its shards;
* those scatters are issued asynchronously, with at most ``bucket_bytes`` per rank in flight, so
  the source's Python loop runs ahead of gloo and the receivers never wait on packing;
* small, uneven and replicated tensors keep the existing bucket path (a collective per few
  hundred KiB would cost more in latency than the copy), with ``torch.empty`` buffers: the
  padding between segments is never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fp32keep import load as _load

DIRECT_BYTES = 1 << 20
"""Shards at least this large (per rank) are scattered alone, straight into place."""


def _pack_empty(
    bucket: _load._Bucket,
    targets: list[_load._Target],
    sources: list[torch.Tensor],
    world: int,
    device: torch.device,
    *,
    sharded: bool,
) -> list[torch.Tensor]:
    """``_load._pack`` with ``torch.empty`` buffers (same layout, no memset)."""
    copies = world if sharded else 1
    buffers = [torch.empty(bucket.size, dtype=torch.uint8, device=device) for _ in range(copies)]
    for (index, placements), full in zip(bucket.entries, sources, strict=True):
        target = targets[index]
        full = full.detach().to(dtype=target.dtype)
        for rank, (offset, nbytes) in enumerate(placements):
            if nbytes == 0:
                continue
            if target.sharded and target.full_shape:
                start, rows = _load._dim0_rows(target.full_shape[0], world, rank)
                piece = full.narrow(0, start, rows)
            else:
                piece = full
            data = piece.contiguous().reshape(-1).view(torch.uint8)
            buffers[rank][offset : offset + nbytes].copy_(data)
            if not target.sharded:
                break
    return buffers


def _direct(target: _load._Target, world: int, direct_bytes: int) -> bool:
    rows = target.full_shape[0] if target.full_shape else 0
    return (
        target.sharded
        and rows > 0
        and rows % world == 0
        and target.local.is_contiguous()
        and target.local.numel() * target.dtype.itemsize >= direct_bytes
    )


@torch.no_grad()
def load_full_state_dict_direct(
    model: nn.Module,
    state_dict: Mapping[str, object] | None,
    *,
    src_rank: int = 0,
    strict: bool = True,
    bucket_bytes: int = _load.DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DIRECT_BYTES,
) -> _load.LoadResult:
    """``fp32keep.load_full_state_dict`` with the proposed data path (same contract)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    targets = _load._targets(model, world)
    _load._agree(state_dict, targets, src_rank, None)
    shared: list[object] = [None]
    if rank == src_rank:
        assert state_dict is not None
        shared[0] = _load._validate(targets, state_dict)
    dist.broadcast_object_list(shared, src=src_rank)
    verdict = shared[0]
    assert isinstance(verdict, _load._Verdict)
    error = _load._verdict_error(verdict, strict, src_rank)
    if error is not None:
        raise error
    device = _load._comm_device(None)
    _load._materialize(model, device)
    targets = _load._targets(model, world)
    present = [i for i, key in enumerate(verdict.sources) if key is not None]

    def source(index: int) -> torch.Tensor:
        assert state_dict is not None
        return cast(torch.Tensor, state_dict[verdict.sources[index] or ""])

    # 1. large even shards: one async scatter each, straight into the local shard.
    in_flight: list[tuple[Any, list[torch.Tensor] | None]] = []
    in_flight_bytes = 0
    for index in (i for i in present if _direct(targets[i], world, direct_bytes)):
        target = targets[index]
        inputs: list[torch.Tensor] | None = None
        if rank == src_rank:
            full = source(index).detach().to(device=device, dtype=target.dtype).contiguous()
            inputs = list(full.chunk(world, dim=0))
        work = dist.scatter(target.local, inputs, src=src_rank, async_op=True)
        in_flight.append((work, inputs))  # inputs stay referenced until their send completes
        in_flight_bytes += target.local.numel() * target.dtype.itemsize
        if in_flight_bytes >= bucket_bytes:
            for pending, _ in in_flight:
                pending.wait()
            in_flight, in_flight_bytes = [], 0
    for pending, _ in in_flight:
        pending.wait()

    # 2. everything else: the library's buckets, unchanged apart from empty() buffers.
    rest = [i for i in present if not _direct(targets[i], world, direct_bytes)]
    for sharded in (True, False):
        indices = [i for i in rest if targets[i].sharded == sharded]
        for bucket in _load._buckets(targets, indices, world, bucket_bytes):
            received = torch.empty(bucket.size, dtype=torch.uint8, device=device)
            packed: list[torch.Tensor] = []
            if rank == src_rank:
                sources = [source(i) for i, _ in bucket.entries]
                packed = _pack_empty(bucket, targets, sources, world, device, sharded=sharded)
            if sharded:
                dist.scatter(received, packed if rank == src_rank else None, src=src_rank)
            else:
                if rank == src_rank:
                    received = packed[0]
                dist.broadcast(received, src=src_rank)
            _load._unpack(bucket, targets, received, rank)
    return _load.LoadResult(verdict.missing, verdict.unexpected)
