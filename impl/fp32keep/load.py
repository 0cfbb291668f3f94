"""Dtype-aligned full-state-dict loading into an FSDP2 model: validate everywhere, then scatter.

The source rank holds the full dict; every other rank passes ``None``. The loader works in three
steps, each a collective every rank takes part in, so a bad dict raises the same error on every
rank instead of leaving a peer waiting:

1. agree: every rank reports whether it holds a dict and a fingerprint of its model's layout;
2. validate: the source rank checks keys, shapes, kinds and dtype families and sends the verdict;
3. move: sharded tensors travel as each rank's own dim-0 shards, packed into byte buckets and
   scattered (each rank receives 1/N of the bytes a broadcast would send it); replicated tensors
   (buffers) are packed the same way and broadcast. The destination dtype always wins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fp32keep.errors import StateDictError
from fp32keep.tensors import tensor_slots

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
DIRECT_BYTES = 1024 * 1024
"""Shards at least this large (per rank) of evenly splitting tensors are scattered alone."""
_ALIGN = 16  # every segment starts 16-byte aligned so a byte view can be viewed as any dtype


@dataclass(frozen=True)
class LoadResult:
    """What a non-strict load skipped.

    Attributes:
        missing_keys: destination tensors with no entry in the state dict (left untouched).
        unexpected_keys: state-dict entries the model does not have (ignored).
    """

    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Target:
    """One destination tensor: its names, its full shape and dtype, how it is laid out."""

    names: tuple[str, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool
    local: torch.Tensor = field(repr=False)

    @property
    def key(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class _Verdict:
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, str], ...]
    # for every target, the state-dict key that feeds it (None when missing)
    sources: tuple[str | None, ...]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _dim0_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The ``(start, length)`` of ``rank``'s dim-0 chunk, as ``torch.chunk`` (and FSDP2) cut it."""
    if rows == 0:
        return 0, 0
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, max(0, min(chunk, rows - start))


def _targets(model: nn.Module, world: int) -> list[_Target]:
    targets: list[_Target] = []
    for slot in tensor_slots(model):
        if not slot.persistent:
            continue
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
            targets.append(
                _Target(slot.names, tuple(tensor.shape), tensor.dtype, True, tensor.to_local())
            )
        else:
            targets.append(_Target(slot.names, tuple(tensor.shape), tensor.dtype, False, tensor))
    return targets


def _fingerprint(targets: Sequence[_Target]) -> str:
    digest = hashlib.sha256()
    for target in targets:
        digest.update(
            repr((target.names, target.full_shape, str(target.dtype), target.sharded)).encode()
        )
    return digest.hexdigest()


def _family(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def _validate(targets: Sequence[_Target], state_dict: Mapping[str, object]) -> _Verdict:
    claimed: set[str] = set()
    missing: list[str] = []
    mismatched: list[tuple[str, str]] = []
    sources: list[str | None] = []
    for target in targets:
        key = next((name for name in target.names if name in state_dict), None)
        claimed.update(name for name in target.names if name in state_dict)
        sources.append(key)
        if key is None:
            missing.append(target.key)
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            mismatched.append((key, f"is a {type(value).__name__}, not a tensor"))
        elif value.is_meta:
            mismatched.append((key, "is on the meta device and holds no data"))
        elif tuple(value.shape) != target.full_shape:
            mismatched.append(
                (key, f"has shape {tuple(value.shape)}, the model expects {target.full_shape}")
            )
        elif _family(value.dtype) != _family(target.dtype):
            mismatched.append(
                (
                    key,
                    f"is {value.dtype} ({_family(value.dtype)}) but the model's tensor is "
                    f"{target.dtype} ({_family(target.dtype)})",
                )
            )
    unexpected = [key for key in state_dict if key not in claimed]
    return _Verdict(tuple(missing), tuple(unexpected), tuple(mismatched), tuple(sources))


def _verdict_error(verdict: _Verdict, strict: bool, src_rank: int) -> StateDictError | None:
    problems: list[str] = []
    if verdict.mismatched:
        problems.append(
            "entries that cannot be loaded:\n"
            + "\n".join(f"  {key}: {reason}" for key, reason in verdict.mismatched)
        )
    if strict and verdict.missing:
        problems.append(f"missing keys ({len(verdict.missing)}): {list(verdict.missing)}")
    if strict and verdict.unexpected:
        problems.append(f"unexpected keys ({len(verdict.unexpected)}): {list(verdict.unexpected)}")
    if not problems:
        return None
    hint = (
        " Pass strict=False to skip missing and unexpected keys." if not verdict.mismatched else ""
    )
    return StateDictError(
        f"the full state dict on rank {src_rank} does not fit the model; nothing was loaded.\n"
        + "\n".join(problems)
        + hint,
        missing=verdict.missing,
        unexpected=verdict.unexpected,
        mismatched=verdict.mismatched,
    )


def _agree(
    state_dict: Mapping[str, object] | None,
    targets: Sequence[_Target],
    src_rank: int,
) -> None:
    rank = dist.get_rank()
    local = (state_dict is not None, _fingerprint(targets))
    gathered: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    holders = [r for r, info in enumerate(gathered) if info is not None and info[0]]
    if holders != [src_rank]:
        where = f"ranks {holders}" if holders else "no rank"
        raise ValueError(
            f"load_full_state_dict: the full state dict is held by {where}; it must be held by "
            f"src_rank={src_rank} alone (pass None on every other rank) [raised on rank {rank}]"
        )
    differing = [r for r, info in enumerate(gathered) if info is not None and info[1] != local[1]]
    if differing:
        raise ValueError(
            f"load_full_state_dict: the model on ranks {differing} differs from rank {rank}'s "
            "(names, shapes or dtypes); every rank must build and shard the same model"
        )


def _materialize(model: nn.Module, device: torch.device) -> None:
    if any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers()):
        model.to_empty(device=device)


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Bucket:
    """A run of targets whose per-rank payloads travel in one collective."""

    entries: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    size: int = 0  # bytes each rank receives (the largest per-rank payload, padded)


def _buckets(
    targets: Sequence[_Target], indices: Sequence[int], world: int, limit: int
) -> Iterator[_Bucket]:
    """Group targets so that no rank receives more than ``limit`` bytes at once (unless one
    tensor alone is larger). Every rank computes the same buckets from shapes alone."""
    bucket = _Bucket()
    offsets = [0] * world
    for index in indices:
        target = targets[index]
        row_bytes = target.dtype.itemsize
        for extent in target.full_shape[1:]:
            row_bytes *= extent
        placements: list[tuple[int, int]] = []
        for rank in range(world):
            if target.sharded:
                _, rows = _dim0_rows(target.full_shape[0] if target.full_shape else 1, world, rank)
                nbytes = rows * row_bytes if target.full_shape else row_bytes
            else:
                nbytes = target.local.numel() * target.dtype.itemsize
            placements.append((offsets[rank], nbytes))
        grown = max(_round_up(o + n, _ALIGN) for o, n in placements)
        if bucket.entries and grown > limit:
            yield bucket
            bucket, offsets = _Bucket(), [0] * world
            placements = [(0, n) for _, n in placements]
            grown = max(_round_up(n, _ALIGN) for _, n in placements)
        bucket.entries.append((index, placements))
        offsets = [_round_up(o + n, _ALIGN) for o, n in placements]
        bucket.size = grown
    if bucket.entries:
        yield bucket


def _pack(
    bucket: _Bucket,
    targets: Sequence[_Target],
    sources: Sequence[torch.Tensor],
    world: int,
    device: torch.device,
    *,
    sharded: bool,
) -> list[torch.Tensor]:
    # A replicated bucket is broadcast: one buffer serves every rank.
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
                start, rows = _dim0_rows(target.full_shape[0], world, rank)
                piece = full.narrow(0, start, rows)
            else:
                piece = full
            data = piece.contiguous().reshape(-1).view(torch.uint8)
            buffers[rank][offset : offset + nbytes].copy_(data)
            if not target.sharded:
                break  # replicated: one copy, broadcast to all
    return buffers


@torch.no_grad()
def _unpack(bucket: _Bucket, targets: Sequence[_Target], received: torch.Tensor, rank: int) -> None:
    for index, placements in bucket.entries:
        target = targets[index]
        offset, nbytes = placements[rank] if target.sharded else placements[0]
        if nbytes == 0:
            continue
        local = target.local
        data = received[offset : offset + nbytes].view(target.dtype).view(local.shape)
        local.copy_(data)


def _scatters_directly(
    target: _Target, world: int, device: torch.device, direct_bytes: int
) -> bool:
    """A large shard of a tensor that splits evenly can be scattered straight into place."""
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
def _scatter_directly(
    targets: Sequence[_Target],
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


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, object] | None,
    *,
    src_rank: int = 0,
    cpu_offload: bool = False,
    strict: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DIRECT_BYTES,
) -> LoadResult:
    """Load a full (unsharded) state dict held by ``src_rank`` into an FSDP2-sharded model.

    Call it on every rank after :func:`fp32keep.apply_fsdp2`; ``src_rank`` passes the dict, every
    other rank passes ``None``. The model may live on the meta device on any rank: it is
    materialised first (on the CPU when ``cpu_offload``, else on the collective's device).

    * The destination dtype wins for parameters and persistent buffers, for every alias
      (``remove_duplicate=False``); tied tensors stay tied. Non-persistent buffers are not
      touched.
    * The caller's mapping is only read: never mutated, its ``_metadata`` untouched.
    * Missing, unexpected, shape-mismatched, non-tensor, meta and wrong-kind (integer where a
      float is expected) entries are found on the source rank and agreed by every rank before any
      tensor moves: every rank raises the same :class:`fp32keep.StateDictError`.
      ``strict=False`` loads what fits and returns the missing and unexpected keys.
    * Each rank receives only its own dim-0 shards. A shard of at least ``direct_bytes`` whose
      tensor splits evenly over the ranks is scattered straight into place (asynchronously, at
      most ``bucket_bytes`` per rank in flight, no packing on either side); the rest are
      coalesced into buckets of at most ``bucket_bytes`` per rank. A non-source rank never holds
      more than its shards plus one bucket.

    Every collective is bounded by the process group's timeout.

    Returns:
        The missing and unexpected keys (empty after a strict load).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "load_full_state_dict needs an initialised process group (launch with torchrun and "
            "call torch.distributed.init_process_group first)"
        )
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        raise ValueError(
            f"{type(model).__name__} is not sharded: call fp32keep.apply_fsdp2(model, ...) "
            "before load_full_state_dict (for an unsharded model use model.load_state_dict)"
        )
    if state_dict is not None and not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    world = dist.get_world_size()
    rank = dist.get_rank()
    if not 0 <= src_rank < world:
        raise ValueError(f"src_rank={src_rank} is not a rank of this {world}-rank process group")
    targets = _targets(model, world)
    _agree(state_dict, targets, src_rank)

    shared: list[object] = [None]
    if rank == src_rank:
        assert state_dict is not None  # _agree checked it
        shared[0] = _validate(targets, state_dict)
    dist.broadcast_object_list(shared, src=src_rank)
    verdict = shared[0]
    assert isinstance(verdict, _Verdict)
    error = _verdict_error(verdict, strict, src_rank)
    if error is not None:
        raise error

    device = _comm_device()
    _materialize(model, torch.device("cpu") if cpu_offload else device)
    targets = _targets(model, world)  # materialising replaced the local tensors
    present = [i for i, key in enumerate(verdict.sources) if key is not None]

    def source(index: int) -> torch.Tensor:
        assert state_dict is not None
        # _validate proved every source entry is a tensor.
        return cast(torch.Tensor, state_dict[verdict.sources[index] or ""])

    direct = [i for i in present if _scatters_directly(targets[i], world, device, direct_bytes)]
    _scatter_directly(targets, direct, source, rank, src_rank, world, device, bucket_bytes)
    chosen = set(direct)
    for sharded in (True, False):
        indices = [i for i in present if targets[i].sharded == sharded and i not in chosen]
        for bucket in _buckets(targets, indices, world, bucket_bytes):
            received = torch.empty(bucket.size, dtype=torch.uint8, device=device)
            if rank == src_rank:
                sources = [source(i) for i, _ in bucket.entries]
                packed = _pack(bucket, targets, sources, world, device, sharded=sharded)
            else:
                packed = []
            if sharded:
                dist.scatter(received, packed if rank == src_rank else None, src=src_rank)
            else:
                if rank == src_rank:
                    received = packed[0]
                dist.broadcast(received, src=src_rank)
            _unpack(bucket, targets, received, rank)
            del packed, received
    return LoadResult(verdict.missing, verdict.unexpected)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2 model on every rank (all-gathers every shard).

    Every alias of a tied tensor appears under each of its names, like ``state_dict()``; values
    are unsharded CPU tensors in the model's storage dtypes. Meant for tests and round trips on
    models that fit in one rank's memory.
    """
    full: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=False).items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        full[name] = tensor.detach().cpu().clone()
    return full
