"""``apply_fsdp2`` checks the plan's dtype against the policy's ``param_dtype`` on every rank,
before anything is sharded (the rule itself: tests/test_plan_use.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import fp32keep
from fp32keep import KeepPlan, KeepPlanError
from tests.core.toys import SEMANTICS, stack_class
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import assert_unchanged, snapshot

pytestmark = pytest.mark.fsdp2

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def cast_stack(dtype: torch.dtype) -> tuple[nn.Module, KeepPlan]:
    torch.manual_seed(0)
    model = stack_class(regular=["wo"], strict=["norm"])()
    plan = fp32keep.resolve_keep_plan(model, dtype, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, dtype, plan=plan)
    return model, plan


def test_a_plan_for_another_dtype_than_the_policy_is_refused_on_every_rank(
    mesh: DeviceMesh,
) -> None:
    # FP32 master weights cast with the fp16 plan, sharded under a bf16 policy: the plan is for
    # neither the storage (FP32) nor the compute dtype
    model, plan = cast_stack(FP16)
    fp32keep.upcast_to_fp32_master(model)
    before = snapshot(model)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan),
        KeepPlanError,
        r"the keep plan was resolved for torch\.float16, but mp_policy\.param_dtype is "
        r"torch\.bfloat16 and nothing is stored in low precision",
    )
    assert "nothing was sharded" in str(error)
    assert_unchanged(model, before)


def test_the_storage_plan_under_another_compute_dtype_is_sharded(mesh: DeviceMesh) -> None:
    """Transformers' ``distributed_config``: loaded in fp16 (the fp16 plan), computed in bf16."""
    model, plan = cast_stack(FP16)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan)
    assert isinstance(model, FSDPModule)


def test_fp32_master_weights_with_the_policys_plan_are_sharded(mesh: DeviceMesh) -> None:
    """The legitimate mix: FP32 storage, a bf16 policy, the plan for bf16."""
    model, plan = cast_stack(BF16)
    fp32keep.upcast_to_fp32_master(model)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan)
    assert isinstance(model, FSDPModule)


def test_a_policy_without_param_dtype_takes_the_storage_plan(mesh: DeviceMesh) -> None:
    """``param_dtype=None`` names no compute dtype: the fp16 plan the storage was cast with."""
    model, plan = cast_stack(FP16)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(), plan=plan)
    assert isinstance(model, FSDPModule)
