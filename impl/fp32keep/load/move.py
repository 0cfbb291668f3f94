"""How :func:`fp32keep.load_full_state_dict` moves tensors once every rank agreed to load.

A sharded tensor (a DTensor of any mesh FSDP2 builds: 1-D, HSDP's replicate x shard, a sub-mesh of
a larger world; ``Shard`` on any dim and ``Replicate`` placements) is described on each rank by
its *box*: the start and length of its local shard along every dimension, computed from this
rank's own mesh coordinate. The ranks gather their boxes before anything moves, so the source rank
knows which bytes every global rank needs; replicas of one shard (HSDP) get the same box.
Sharded tensors travel as each rank's own box, packed into byte buckets and scattered over the
whole process group; replicated tensors (buffers, parameters left out of FSDP2) are packed the
same way and broadcast. Large shards cut along dim 0 into equal pieces are scattered straight
into place. Every rank computes the same buckets from shapes and boxes alone, so every collective
here has the same sizes on every rank.

The source rank's extra memory is bounded whatever the world size: a bucket holds at most
``bucket_bytes`` summed over every destination (or one tensor's boxes, when one tensor alone is
larger), one bucket is in flight at a time, and the direct scatters keep at most ``bucket_bytes``
of converted copies alive (views of the caller's tensors cost nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fp32keep.errors import Fp32KeepNotImplementedError, hidden_in_tracebacks
from fp32keep.tensors import tensor_slots

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

_ALIGN = 16  # every segment starts 16-byte aligned so a byte view can be viewed as any dtype

Box = tuple[tuple[int, int], ...]
"""A block of a full tensor: ``(start, length)`` along every dimension."""


@dataclass(frozen=True)
class Target:
    """One destination tensor: its names, its full shape and dtype, how it is laid out.

    ``persistent`` is False for a non-persistent buffer: in no state dict, sent from the source
    rank's own model when another rank holds it on the meta device. ``box`` is this rank's block
    of the full tensor (the whole tensor when it is not sharded). ``registered`` is the tensor the
    model registers (a sharded parameter's DTensor, whose local shard is ``local``).
    """

    names: tuple[str, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool
    persistent: bool
    local: torch.Tensor = field(repr=False)
    box: Box = ()
    registered: torch.Tensor | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return self.names[0]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def dim0_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The ``(start, length)`` of ``rank``'s chunk of ``rows``, as ``torch.chunk`` (and FSDP2)
    cut it."""
    if rows == 0:
        return 0, 0
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, max(0, min(chunk, rows - start))


def whole(shape: Sequence[int]) -> Box:
    return tuple((0, extent) for extent in shape)


def box_bytes(box: Box, dtype: torch.dtype) -> int:
    return math.prod(length for _, length in box) * dtype.itemsize


def local_box(name: str, tensor: DTensor) -> Box:
    """This rank's block of ``tensor``, from its own coordinate in the DTensor's mesh.

    Placements apply left to right over the mesh dimensions, each ``Shard(d)`` cutting the
    current extent of dim ``d`` as ``torch.chunk`` does (DTensor's and FSDP2's rule).

    Raises:
        NotImplementedError: a placement other than ``Shard``/``Replicate`` (``Partial``,
            tensor parallelism's strided shards), or a rank outside the tensor's mesh.
    """
    shape = tuple(tensor.shape)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    supported = all(type(p) in (Shard, Replicate) for p in tensor.placements)
    if coordinate is None or not supported:
        raise Fp32KeepNotImplementedError(
            f"{name} is sharded as {tuple(tensor.placements)} over a mesh of shape "
            f"{tuple(mesh.shape)}; load_full_state_dict supports FSDP2's Shard and Replicate "
            "placements (FSDP, HSDP, sub-meshes, shard_placement_fn) on meshes that hold this "
            "rank. For tensor-parallel (Partial or strided) placements use "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict"
        )
    starts, lengths = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            dim = placement.dim % len(shape)
            start, length = dim0_rows(lengths[dim], mesh.size(mesh_dim), coordinate[mesh_dim])
            starts[dim] += start
            lengths[dim] = length
    return tuple(zip(starts, lengths, strict=True))


def collect_targets(model: nn.Module) -> list[Target]:
    """Every parameter and buffer of ``model`` (tied aliases as one), sorted by name.

    Raises:
        NotImplementedError: a parameter whose placements :func:`local_box` cannot serve, or
            whose local shard is not the block its placements say.
    """
    targets: list[Target] = []
    for slot in tensor_slots(model):
        tensor = slot.tensor
        if isinstance(tensor, DTensor):
            box = local_box(slot.name, tensor)
            local = tensor.to_local()
            if tuple(local.shape) != tuple(length for _, length in box):
                raise Fp32KeepNotImplementedError(
                    f"{slot.name}: its local shard has shape {tuple(local.shape)}, not the "
                    f"{tuple(length for _, length in box)} its placements "
                    f"{tuple(tensor.placements)} give; load_full_state_dict cannot place it. "
                    "Use torch.distributed.checkpoint.state_dict.set_model_state_dict"
                )
            full = tuple(tensor.shape)
            targets.append(Target(slot.names, full, tensor.dtype, True, True, local, box, tensor))
        else:
            shape = tuple(tensor.shape)
            targets.append(
                Target(
                    slot.names,
                    shape,
                    tensor.dtype,
                    False,
                    slot.persistent,
                    tensor,
                    whole(shape),
                    tensor,
                )
            )
    # Collectives pair tensors by position, so every rank must list them in the same order, and
    # module order is not always the same across processes: Gemma3's rotary module registers
    # its buffers while iterating a set of layer types (their order follows PYTHONHASHSEED).
    targets.sort(key=lambda target: target.names)
    return targets


@dataclass
class Bucket:
    """A run of targets whose per-rank payloads travel in one collective.

    ``entries`` holds, per target, ``(offset, nbytes)`` for every rank (scattered) or one pair
    (broadcast); ``size`` is the bytes each rank receives (the largest payload, padded).
    """

    entries: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    size: int = 0


def buckets(
    targets: Sequence[Target],
    indices: Sequence[int],
    boxes: Sequence[Sequence[Box]],
    limit: int,
) -> Iterator[Bucket]:
    """Group targets so that the source rank never packs more than ``limit`` bytes at once,
    summed over every destination (unless one tensor alone is larger).

    ``boxes[rank][index]`` is ``rank``'s block of target ``index``. Every rank computes the same
    buckets from shapes and the gathered boxes alone.
    """
    world = len(boxes)
    bucket = Bucket()
    offsets = [0] * world
    for index in indices:
        target = targets[index]
        if target.sharded:
            sizes = [box_bytes(boxes[rank][index], target.dtype) for rank in range(world)]
        else:  # one payload, broadcast to every rank
            sizes = [target.local.numel() * target.dtype.itemsize]
        copies = len(sizes)
        placements = list(zip(offsets[:copies], sizes, strict=True))
        grown = max(round_up(o + n, _ALIGN) for o, n in placements)
        if bucket.entries and grown * copies > limit:
            yield bucket
            bucket, offsets = Bucket(), [0] * world
            placements = [(0, n) for n in sizes]
            grown = max(round_up(n, _ALIGN) for n in sizes)
        bucket.entries.append((index, placements))
        for rank, (offset, nbytes) in enumerate(placements):
            offsets[rank] = round_up(offset + nbytes, _ALIGN)
        bucket.size = max(bucket.size, grown)
    if bucket.entries:
        yield bucket


def block(full: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``full`` that ``box`` covers."""
    piece = full
    for dim, (start, length) in enumerate(box):
        if start != 0 or length != full.shape[dim]:
            piece = piece.narrow(dim, start, length)
    return piece


@torch.no_grad()
def pack(
    bucket: Bucket,
    targets: Sequence[Target],
    sources: Sequence[torch.Tensor],
    boxes: Sequence[Sequence[Box]],
    device: torch.device,
    *,
    sharded: bool,
) -> list[torch.Tensor]:
    """The source rank's send buffers for ``bucket``: one per rank, or one to broadcast.

    Each block is copied once, straight from the caller's tensor into the buffer (the copy
    casts to the destination dtype), so nothing but the bucket itself is allocated.
    """
    copies = len(boxes) if sharded else 1
    # empty, not zeros: the padding between segments is never read, and a memset of every
    # bucket cost as much as the copies (profiled on a 1.35 GB load).
    storage = torch.empty(copies * bucket.size, dtype=torch.uint8, device=device)
    buffers = [storage[r * bucket.size : (r + 1) * bucket.size] for r in range(copies)]
    for (index, placements), full in zip(bucket.entries, sources, strict=True):
        target = targets[index]
        for rank, (offset, nbytes) in enumerate(placements):
            if nbytes == 0:
                continue
            box = boxes[rank][index] if sharded else target.box
            # The destination dtype wins over the checkpoint's, for every alias; a strided or
            # expanded view in the checkpoint packs as its values.
            segment = buffers[rank][offset : offset + nbytes].view(target.dtype)
            segment.view([length for _, length in box]).copy_(block(full.detach(), box))
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


def scatters_directly(target: Target, device: torch.device, direct_bytes: int) -> bool:
    """This rank's shard of ``target`` can receive a scatter straight into place.

    Decided per rank from the local shard, so the ranks must agree on the result (and on
    :func:`cut_evenly`) before use.
    """
    local = target.local
    return (
        target.sharded
        and local.is_contiguous()
        and local.device == device  # an offloaded CPU shard cannot receive an NCCL scatter
        and local.numel() * target.dtype.itemsize >= direct_bytes
    )


def cut_evenly(target: Target, blocks: Sequence[Box]) -> bool:
    """Every rank's block is a run of whole dim-0 rows, all of one size (a scatter's rule)."""
    if not target.sharded or not target.full_shape:
        return False
    rest = whole(target.full_shape)[1:]
    sizes = {box[0][1] for box in blocks}
    return all(box[1:] == rest for box in blocks) and len(sizes) == 1 and sizes != {0}


@torch.no_grad()
def scatter_directly(
    targets: Sequence[Target],
    indices: Sequence[int],
    source: Callable[[int], torch.Tensor],
    boxes: Sequence[Sequence[Box]],
    rank: int,
    src_rank: int,
    device: torch.device,
    window_bytes: int,
    in_flight_work: Callable[[], None] = lambda: None,
) -> None:
    """One asynchronous scatter per tensor into each rank's local shard.

    The scatter inputs are row ranges of the checkpoint's own tensors (views; replicas of one
    shard share one), so nothing is packed; only a dtype or device change makes a copy, and at
    most ``window_bytes`` of such copies are in flight on the source rank. ``in_flight_work``
    runs once every scatter is posted, before the first wait: work that reads none of the
    received values overlaps the transfer there.
    """
    in_flight: list[tuple[dist.Work, list[torch.Tensor] | None]] = []
    pending = 0
    for index in indices:
        target = targets[index]
        inputs: list[torch.Tensor] | None = None
        if rank == src_rank:
            given = source(index).detach()
            full = given.to(device=device, dtype=target.dtype)
            made = full.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
            pending += full.numel() * full.element_size() if made else 0
            pieces: dict[tuple[int, int], torch.Tensor] = {}
            for blocks in boxes:
                start, rows = blocks[index][0]
                if (start, rows) not in pieces:
                    piece = full.narrow(0, start, rows)
                    if not piece.is_contiguous():
                        pending += piece.numel() * piece.element_size()
                        piece = piece.contiguous()
                    pieces[start, rows] = piece
            inputs = [pieces[blocks[index][0]] for blocks in boxes]
        work = dist.scatter(target.local, inputs, src=src_rank, async_op=True)
        assert work is not None
        in_flight.append((work, inputs))  # the inputs must live until their send completes
        if pending >= window_bytes:
            for done, _ in in_flight:
                done.wait()
            in_flight, pending = [], 0
    in_flight_work()
    for done, _ in in_flight:
        done.wait()


def move(
    targets: Sequence[Target],
    present: Sequence[int],
    direct: Sequence[int],
    source: Callable[[int], torch.Tensor],
    keep: frozenset[int],
    boxes: Sequence[Sequence[Box]],
    *,
    rank: int,
    src_rank: int,
    device: torch.device,
    bucket_bytes: int,
    in_flight_work: Callable[[], None] = lambda: None,
) -> None:
    """Send every target in ``present`` from ``src_rank`` into place on every rank.

    ``direct`` (a subset of ``present``, agreed by every rank) is scattered straight into place;
    ``keep`` lists targets this rank receives but must not write (its own copy is real);
    ``boxes[r][i]`` is rank ``r``'s block of target ``i``. ``in_flight_work`` runs while the
    direct scatters are on the wire (see :func:`scatter_directly`).
    """
    scatter_directly(
        targets, direct, source, boxes, rank, src_rank, device, bucket_bytes, in_flight_work
    )
    chosen = set(direct)
    for sharded in (True, False):
        indices = [i for i in present if targets[i].sharded == sharded and i not in chosen]
        for bucket in buckets(targets, indices, boxes, bucket_bytes):
            packed: list[torch.Tensor] = []
            if rank == src_rank:
                sources = [source(i) for i, _ in bucket.entries]
                packed = pack(bucket, targets, sources, boxes, device, sharded=sharded)
            if sharded:
                received = torch.empty(bucket.size, dtype=torch.uint8, device=device)
                dist.scatter(received, packed if rank == src_rank else None, src=src_rank)
            else:
                received = (
                    packed[0]
                    if rank == src_rank
                    else torch.empty(bucket.size, dtype=torch.uint8, device=device)
                )
                dist.broadcast(received, src=src_rank)
            unpack(bucket, targets, received, rank, keep)
            del packed, received
