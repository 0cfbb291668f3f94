"""How :func:`fp32keep.load_full_state_dict` moves tensors once every rank agreed to load.

Sharded tensors travel as each rank's own dim-0 shards, packed into byte buckets and scattered
(each rank receives 1/N of the bytes a broadcast would send it); replicated tensors (buffers,
parameters left out of FSDP2) are packed the same way and broadcast. Large shards of tensors that
split evenly are scattered straight into place. Every rank computes the same buckets from shapes
alone, so every collective here has the same sizes on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fp32keep.tensors import tensor_slots

_ALIGN = 16  # every segment starts 16-byte aligned so a byte view can be viewed as any dtype


@dataclass(frozen=True)
class Target:
    """One destination tensor: its names, its full shape and dtype, how it is laid out.

    ``persistent`` is False for a non-persistent buffer: in no state dict, sent from the source
    rank's own model when another rank holds it on the meta device.
    """

    names: tuple[str, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool
    persistent: bool
    local: torch.Tensor = field(repr=False)

    @property
    def key(self) -> str:
        return self.names[0]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def dim0_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The ``(start, length)`` of ``rank``'s dim-0 chunk, as ``torch.chunk`` (and FSDP2) cut it."""
    if rows == 0:
        return 0, 0
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, max(0, min(chunk, rows - start))


def collect_targets(model: nn.Module, world: int) -> list[Target]:
    """Every parameter and buffer of ``model`` (tied aliases as one), sorted by name.

    Raises:
        NotImplementedError: a parameter is sharded other than FSDP2's default dim-0 sharding
            on a 1-D mesh over the whole process group.
    """
    targets: list[Target] = []
    for slot in tensor_slots(model):
        tensor = slot.tensor
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),) or mesh.size() != world:
                raise NotImplementedError(
                    f"{slot.name} is sharded as {tuple(tensor.placements)} over a mesh of shape "
                    f"{tuple(mesh.shape)}; load_full_state_dict supports FSDP2's default dim-0 "
                    "sharding on a 1-D mesh over the whole process group. For HSDP or a custom "
                    "shard_placement_fn use torch.distributed.checkpoint.state_dict."
                    "set_model_state_dict"
                )
            local = tensor.to_local()
            targets.append(Target(slot.names, tuple(tensor.shape), tensor.dtype, True, True, local))
        else:
            shape = tuple(tensor.shape)
            targets.append(Target(slot.names, shape, tensor.dtype, False, slot.persistent, tensor))
    # Collectives pair tensors by position, so every rank must list them in the same order, and
    # module order is not always the same across processes: Gemma3's rotary module registers
    # its buffers while iterating a set of layer types (their order follows PYTHONHASHSEED).
    targets.sort(key=lambda target: target.names)
    return targets


@dataclass
class Bucket:
    """A run of targets whose per-rank payloads travel in one collective."""

    entries: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    size: int = 0  # bytes each rank receives (the largest per-rank payload, padded)


def buckets(
    targets: Sequence[Target], indices: Sequence[int], world: int, limit: int
) -> Iterator[Bucket]:
    """Group targets so that no rank receives more than ``limit`` bytes at once (unless one
    tensor alone is larger). Every rank computes the same buckets from shapes alone."""
    bucket = Bucket()
    offsets = [0] * world
    for index in indices:
        target = targets[index]
        row_bytes = target.dtype.itemsize
        for extent in target.full_shape[1:]:
            row_bytes *= extent
        placements: list[tuple[int, int]] = []
        for rank in range(world):
            if target.sharded:
                _, rows = dim0_rows(target.full_shape[0] if target.full_shape else 1, world, rank)
                nbytes = rows * row_bytes if target.full_shape else row_bytes
            else:
                nbytes = target.local.numel() * target.dtype.itemsize
            placements.append((offsets[rank], nbytes))
        grown = max(round_up(o + n, _ALIGN) for o, n in placements)
        if bucket.entries and grown > limit:
            yield bucket
            bucket, offsets = Bucket(), [0] * world
            placements = [(0, n) for _, n in placements]
            grown = max(round_up(n, _ALIGN) for _, n in placements)
        bucket.entries.append((index, placements))
        offsets = [round_up(o + n, _ALIGN) for o, n in placements]
        bucket.size = grown
    if bucket.entries:
        yield bucket


def pack(
    bucket: Bucket,
    targets: Sequence[Target],
    sources: Sequence[torch.Tensor],
    world: int,
    device: torch.device,
    *,
    sharded: bool,
) -> list[torch.Tensor]:
    """The source rank's send buffers for ``bucket``: one per rank, or one to broadcast."""
    copies = world if sharded else 1
    # empty, not zeros: the padding between segments is never read, and a memset of every
    # bucket cost as much as the copies (profiled on a 1.35 GB load).
    buffers = [torch.empty(bucket.size, dtype=torch.uint8, device=device) for _ in range(copies)]
    for (index, placements), full in zip(bucket.entries, sources, strict=True):
        target = targets[index]
        # The destination dtype wins over the checkpoint's, for every alias.
        full = full.detach().to(dtype=target.dtype)
        for rank, (offset, nbytes) in enumerate(placements):
            if nbytes == 0:
                continue
            if target.sharded and target.full_shape:
                start, rows = dim0_rows(target.full_shape[0], world, rank)
                piece = full.narrow(0, start, rows)
            else:
                piece = full
            # contiguous(): a strided or expanded view in the checkpoint packs as its values
            data = piece.contiguous().reshape(-1).view(torch.uint8)
            buffers[rank][offset : offset + nbytes].copy_(data)
            if not target.sharded:
                break  # replicated: one copy, broadcast to all
    return buffers


@torch.no_grad()
def unpack(
    bucket: Bucket,
    targets: Sequence[Target],
    received: torch.Tensor,
    rank: int,
    keep: frozenset[int] = frozenset(),
) -> None:
    """Copy this rank's segments of ``received`` into place, except the targets in ``keep``."""
    for index, placements in bucket.entries:
        if index in keep:
            continue
        target = targets[index]
        offset, nbytes = placements[rank] if target.sharded else placements[0]
        if nbytes == 0:
            continue
        local = target.local
        data = received[offset : offset + nbytes].view(target.dtype).view(local.shape)
        local.copy_(data)


def scatters_directly(target: Target, world: int, device: torch.device, direct_bytes: int) -> bool:
    """A large shard of a tensor that splits evenly can be scattered straight into place.

    Decided per rank from the local shard, so the ranks must agree on the result before use.
    """
    rows = target.full_shape[0] if target.full_shape else 0
    local = target.local
    return (
        target.sharded
        and rows > 0
        and rows % world == 0
        and local.is_contiguous()
        and local.device == device  # an offloaded CPU shard cannot receive an NCCL scatter
        and local.numel() * target.dtype.itemsize >= direct_bytes
    )


@torch.no_grad()
def scatter_directly(
    targets: Sequence[Target],
    indices: Sequence[int],
    source: Callable[[int], torch.Tensor],
    rank: int,
    src_rank: int,
    world: int,
    device: torch.device,
    window_bytes: int,
) -> None:
    """One asynchronous scatter per tensor into each rank's local shard, ``window_bytes`` in flight.

    Even rows make every chunk the same size, so the checkpoint's own chunks (views, unless the
    dtype changes) are the scatter inputs and the local shard is the output: nothing is packed.
    """
    in_flight: list[tuple[dist.Work, list[torch.Tensor] | None]] = []
    pending = 0
    for index in indices:
        target = targets[index]
        inputs: list[torch.Tensor] | None = None
        if rank == src_rank:
            full = source(index).detach().to(device=device, dtype=target.dtype).contiguous()
            inputs = list(full.chunk(world, dim=0))
        work = dist.scatter(target.local, inputs, src=src_rank, async_op=True)
        assert work is not None
        in_flight.append((work, inputs))  # the inputs must live until their send completes
        pending += target.local.numel() * target.dtype.itemsize
        if pending >= window_bytes:
            for done, _ in in_flight:
                done.wait()
            in_flight, pending = [], 0
    for done, _ in in_flight:
        done.wait()


def move(
    targets: Sequence[Target],
    present: Sequence[int],
    direct: Sequence[int],
    source: Callable[[int], torch.Tensor],
    keep: frozenset[int],
    *,
    rank: int,
    src_rank: int,
    world: int,
    device: torch.device,
    bucket_bytes: int,
) -> None:
    """Send every target in ``present`` from ``src_rank`` into place on every rank.

    ``direct`` (a subset of ``present``, agreed by every rank) is scattered straight into place;
    ``keep`` lists targets this rank receives but must not write (its own copy is real).
    """
    scatter_directly(targets, direct, source, rank, src_rank, world, device, bucket_bytes)
    chosen = set(direct)
    for sharded in (True, False):
        indices = [i for i in present if targets[i].sharded == sharded and i not in chosen]
        for bucket in buckets(targets, indices, world, bucket_bytes):
            received = torch.empty(bucket.size, dtype=torch.uint8, device=device)
            if rank == src_rank:
                sources = [source(i) for i, _ in bucket.entries]
                packed = pack(bucket, targets, sources, world, device, sharded=sharded)
            else:
                packed = []
            if sharded:
                dist.scatter(received, packed if rank == src_rank else None, src=src_rank)
            else:
                if rank == src_rank:
                    received = packed[0]
                dist.broadcast(received, src=src_rank)
            unpack(bucket, targets, received, rank, keep)
            del packed, received
