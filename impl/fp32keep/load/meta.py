"""Storage for a rank's meta-device tensors, received into first and installed in the model later.

Materialising a meta model through ``nn.Module._apply`` (what ``to_empty`` does, and what keeps
FSDP2's bookkeeping right: ``FSDPModule._apply`` re-pads each sharded parameter) costs about
0.5-1 ms of CPU per tensor, DTensor dispatch and ``Parameter`` re-wrapping (profiled on the
benchmark's 1.35 GB Llama: 185 tensors, 0.1-0.2 s). Done before the first byte moved, it was most
of the gap between the load and a raw gloo ``scatter`` of the same bytes (80 % of it). Here
allocation and installation are split, so that the installation overlaps the transfer:

1. :func:`allocate` gives every meta target a plain contiguous tensor of its local shape on the
   load's device (no copy, no zero-fill: its pages are first touched by the receive).
   An allocation that fails is reported and agreed like any other problem, before anything moves;
   the model is not changed.
2. The loader receives straight into those tensors, and while the bytes of the direct scatters
   are on the wire, :meth:`Fresh.install` puts them into the model through ``_apply``: each
   sharded parameter becomes a DTensor over its fresh local tensor (FSDP2 keeps that very storage
   when no padding or pinning is needed), each buffer the fresh tensor itself.
3. Where ``_apply`` did copy (FSDP2 pads an uneven shard, pins a CPU-offloaded one), the copy read
   the storage before its bytes arrived; :meth:`Fresh.finish` copies the received values into the
   installed tensor once every collective is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp32keep._torch.modules import apply_to_tensors
from fp32keep.errors import hidden_in_tracebacks
from fp32keep.load.move import Target

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


@dataclass
class Fresh:
    """This rank's fresh storage, one tensor per meta target, and what installing it did.

    Attributes:
        storage: ``id`` of the registered meta tensor (a DTensor parameter or a plain tensor) to
            the plain tensor that receives its local values.
        keys: the first name of each of those targets, in the same order as ``storage``.
        copies: ``(received, installed)`` pairs where ``_apply`` put other storage in the model.
        error: what installing raised on this rank, if it did (agreed after the move).
    """

    storage: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    error: BaseException | None = None

    def install(self, model: nn.Module) -> None:
        """Make the fresh tensors the model's own; never raises (``error`` records it).

        Reads no tensor values, so it may run while receives into the fresh storage are in
        flight. One result per registered tensor keeps tied tensors tied.
        """
        if not self.storage:
            return
        made: dict[int, torch.Tensor] = {}

        def materialize(tensor: torch.Tensor) -> torch.Tensor:
            entry = self.storage.get(id(tensor))
            if entry is None:
                return tensor
            if id(tensor) not in made:
                registered, local = entry
                if isinstance(registered, DTensor):
                    made[id(tensor)] = DTensor.from_local(
                        local,
                        registered.device_mesh,
                        registered.placements,
                        run_check=False,
                        shape=registered.shape,
                        stride=registered.stride(),
                    )
                else:
                    made[id(tensor)] = local
            return made[id(tensor)]

        try:
            apply_to_tensors(model, materialize)
            for key, (_, received) in zip(self.keys, self.storage.values(), strict=True):
                installed = _registered_local(model, key)
                if not _same_memory(installed, received):
                    self.copies.append((received, installed))
        except Exception as exc:  # recorded; every rank learns of it after the move
            self.error = exc

    @torch.no_grad()
    def finish(self) -> None:
        """Copy the received values into tensors that ``_apply`` re-allocated (see module doc)."""
        for received, installed in self.copies:
            installed.copy_(received)
        self.copies.clear()


def allocate(targets: Sequence[Target], device: torch.device) -> tuple[list[Target], Fresh]:
    """Fresh storage on ``device`` for every meta target; the targets now point at it.

    The model is not touched. Raises what the allocation raises (out of memory, for one).
    """
    fresh = Fresh()
    placed: list[Target] = []
    for target in targets:
        if target.local.is_meta:
            # torch.empty, not empty_like: contiguous, without empty_like's Python path for meta
            # inputs (5x slower per call here, and 2 s on its first call in a process)
            local = torch.empty(target.local.shape, dtype=target.local.dtype, device=device)
            registered = target.local if target.registered is None else target.registered
            fresh.storage[id(registered)] = (registered, local)
            fresh.keys.append(target.key)
            target = replace(target, local=local)
        placed.append(target)
    return placed, fresh


def _registered_local(model: nn.Module, key: str) -> torch.Tensor:
    owner, _, leaf = key.rpartition(".")
    tensor = getattr(model.get_submodule(owner), leaf)
    assert isinstance(tensor, torch.Tensor), key
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True  # nothing to receive, nothing to copy
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )
