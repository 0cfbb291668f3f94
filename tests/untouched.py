"""What "nothing was half-done" means after a refusal, checked the same way by every test.

No module became an ``FSDPModule``; every parameter is the same object with the same dtype and
the same values (this rank's shard, once sharded); the caller's state dict holds the same objects
with the same values.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

Snapshot = dict[str, tuple[int, torch.dtype, torch.Tensor]]


def fsdp_modules(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def snapshot(model: nn.Module) -> Snapshot:
    """Identity, dtype and this rank's values (its shard, once sharded) of every parameter."""
    return {
        name: (id(param), param.dtype, _local(param).detach().clone())
        for name, param in model.named_parameters()
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def assert_unchanged(model: nn.Module, before: Snapshot) -> None:
    """No module became an ``FSDPModule`` and no parameter changed."""
    assert fsdp_modules(model) == []
    assert_same_parameters(model, before)


def assert_same_parameters(model: nn.Module, before: Snapshot) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (identity, dtype, value) in before.items():
        assert after[name][0] == identity, name
        assert after[name][1] == dtype, name
        assert torch.equal(after[name][2], value), name


def dict_snapshot(state: Mapping[str, object]) -> dict[str, tuple[int, object]]:
    """The caller's mapping as the loader must leave it: same objects, same values."""
    return {
        key: (id(value), value.clone() if isinstance(value, torch.Tensor) else copy.copy(value))
        for key, value in state.items()
    }


def assert_dict_unchanged(
    state: Mapping[str, object], before: dict[str, tuple[int, object]]
) -> None:
    assert list(state) == list(before)
    for key, (identity, value) in before.items():
        now = state[key]
        assert id(now) == identity, key
        if isinstance(value, torch.Tensor):
            assert isinstance(now, torch.Tensor) and now.dtype == value.dtype, key
            assert value.is_meta or torch.equal(now, value), key
        else:
            assert now == value, key
