"""Plug-ins for ``fp32keep check --cast/--shard/--load/--policy`` tests, importable as
``tests.cli.plugins:NAME``: a correct implementation, known-wrong ones (the negative controls)
and values that are wrong in each way the command must refuse before any rank starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import KeepPlan, WrapSpec

#: Where :func:`logged_policy` appends one line per call (set by the test that reads it).
POLICY_LOG = "FP32KEEP_TEST_POLICY_LOG"


def keep_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """Correct: a framework that delegates to fp32keep's keep-aware wrapping."""
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)


def summing_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """fp32keep's wrapping with gradients summed over the ranks, not averaged (torchtitan's
    ``disable_fsdp_gradient_division``): correct once the scale is declared to the contract.
    Sums are forced into the collective itself, since gloo has no ``PREMUL_SUM``."""
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def blanket_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """Known wrong: every ``_no_split_modules`` block and the root sharded with the one policy,
    so kept tensors are all-gathered in its ``param_dtype`` (what plain FSDP2 wrappers do)."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules())[1:]:
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def blanket_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """Known wrong: every tensor cast to ``dtype``, kept ones included."""
    model.to(dtype)


def keep_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """Correct: fp32keep's keep-aware cast."""
    fp32keep.keep_aware_cast(model, dtype, plan=plan)


def keep_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """Correct: fp32keep's loader."""
    fp32keep.load_full_state_dict(model, state_dict)


def logged_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The contract's default policy, each call logged (rank and dtype) to the file
    ``$FP32KEEP_TEST_POLICY_LOG`` names, so that a test sees the ranks called it."""
    path = os.environ.get(POLICY_LOG)
    if path:
        rank = dist.get_rank() if dist.is_initialized() else "command"
        with Path(path).open("a") as log:
            log.write(f"{rank} {dtype}\n")
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def fixed_policy() -> MixedPrecisionPolicy:
    """A policy function of no argument, as Transformers' ``transformers_policy()``."""
    return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


# --- values the command refuses before any rank starts -----------------------------------------


def shard_without_keywords(model: nn.Module, mesh: DeviceMesh) -> None:
    """Wrong signature for --shard: ``mesh`` positional, no ``mp_policy``, ``plan``, ``wrap``."""


def cast_of_two(model: nn.Module, dtype: torch.dtype) -> None:
    """Wrong signature for --cast: no ``plan``."""


def policy_of_two(dtype: torch.dtype, world: int) -> MixedPrecisionPolicy:
    """Wrong signature for --policy: two required arguments."""
    return MixedPrecisionPolicy()


def policy_returning_a_dict(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Wrong --policy: returns a dict, not a MixedPrecisionPolicy."""
    return {"param_dtype": dtype}


NOT_CALLABLE = 3
