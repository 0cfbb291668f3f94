"""The rank side of ``bench_load.py``'s loader arms, and the shard hashes every arm must match.

Each loader takes ``(model, state_dict or None, bucket_bytes)`` on every rank: fp32keep, DCP's
``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` and accelerate's
per-tensor broadcast loop (see ``bench_load.py``'s docstring for what each arm is).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

import fp32keep


def local_hash(model: Any) -> str:
    """sha256 over every local shard (name order), as the rank holds it after the load."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        local = value.to_local() if isinstance(value, DTensor) else value
        digest.update(name.encode())
        digest.update(str(local.dtype).encode())
        hash_bytes(digest, local)
    return digest.hexdigest()


def hash_bytes(digest: Any, tensor: Any) -> None:
    """Feed a tensor's raw bytes to ``digest`` without copying them (a numpy view)."""
    digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def expected_hashes(
    state_dict: Mapping[str, Any], world: int, dtype: torch.dtype = torch.float32
) -> list[str]:
    """What :func:`_local_hash` must give on each rank: FSDP2's dim-0 ``torch.chunk`` pieces."""
    digests = [hashlib.sha256() for _ in range(world)]
    for name, full in sorted(state_dict.items()):
        full = full.to(dtype)
        chunks = list(torch.chunk(full, world, dim=0))
        for rank, digest in enumerate(digests):
            piece = chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
            digest.update(name.encode())
            digest.update(str(piece.dtype).encode())
            hash_bytes(digest, piece)
    return [digest.hexdigest() for digest in digests]


Loader = Callable[[Any, Mapping[str, Any] | None, int], None]


def loaders() -> dict[str, Loader]:
    def load_fp32keep(model: Any, state_dict: Mapping[str, Any] | None, bucket: int) -> None:
        fp32keep.load_full_state_dict(model, state_dict, bucket_bytes=bucket)

    def load_dcp(model: Any, state_dict: Mapping[str, Any] | None, bucket: int) -> None:
        # DCP pops and re-inserts keys of the dict it is given: hand it a shallow copy.
        given = dict(state_dict) if state_dict is not None else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, given, options=options)

    def broadcast_loop(src_data_rank: int | None) -> Loader:
        def load(model: Any, state_dict: Mapping[str, Any] | None, bucket: int) -> None:
            # accelerate's fsdp2_load_full_state_dict, minus its Accelerator plumbing.
            rank = dist.get_rank()
            sharded: dict[str, torch.Tensor] = {}
            for name, meta in model.state_dict().items():
                assert isinstance(meta, DTensor)
                if rank == 0:
                    assert state_dict is not None
                    full = state_dict[name].detach().to(device="cpu", dtype=meta.dtype)
                else:
                    full = torch.empty(meta.size(), dtype=meta.dtype, device="cpu")
                dist.broadcast(full, src=0)
                sharded[name] = distribute_tensor(
                    full, meta.device_mesh, meta.placements, src_data_rank=src_data_rank
                )
            model.load_state_dict(sharded, assign=True)

        return load

    return {
        "fp32keep": load_fp32keep,
        "dcp": load_dcp,
        "broadcast": broadcast_loop(0),
        "broadcast-local": broadcast_loop(None),
    }
