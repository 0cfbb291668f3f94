"""A keep plan is refused where it does not fit: a cast to another dtype, a policy computing in
another low-precision dtype. On a real T5 (the zoo's tiny one): its ``wo`` is kept at fp16 only
in 5.1+, so an fp16 plan used for a bf16 cast silently kept ``wo`` in FP32 before.

The policy check is called here as :func:`fp32keep.apply_fsdp2` calls it; that it is called
there, before anything is sharded, is tests/multirank/test_plan_use_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp32keep
from fp32keep import KeepPlanError
from fp32keep.plan.use import check_plan_for_policy
from pytest_fp32keep.check.zoo import ZOO
from tests.error_bounds import LIBRARY_BOUND_S, within
from tests.untouched import assert_same_parameters, snapshot

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def t5() -> nn.Module:
    return ZOO["t5"].build()


def wo_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if n.endswith(".wo.weight")}


def test_an_fp16_plan_for_a_bf16_cast_is_refused_naming_both_dtypes() -> None:
    if ZOO["t5"].expectation(BF16) is not None:  # written table: 5.0.0 keeps wo at bf16 too
        pytest.skip("this Transformers keeps T5's wo at bf16 too: the plans do not differ")
    model = t5()
    fp16_plan = fp32keep.resolve_keep_plan(model, FP16)
    assert any(name.endswith(".wo.weight") for name in fp16_plan.param_names)
    before = snapshot(model)
    with within(LIBRARY_BOUND_S), pytest.raises(KeepPlanError) as error:
        fp32keep.keep_aware_cast(model, BF16, plan=fp16_plan)
    message = str(error.value)
    assert "keep_aware_cast(dtype=torch.bfloat16)" in message
    assert "resolved for torch.float16" in message
    assert "plan=fp32keep.resolve_keep_plan(model, torch.bfloat16)" in message  # the fix
    assert isinstance(error.value, ValueError)
    assert_same_parameters(model, before)  # checked before anything was cast


def test_negative_control_what_the_refused_cast_would_have_done() -> None:
    """The bug the check prevents, shown with the plan's dtype check bypassed: the fp16 plan
    keeps ``wo`` FP32 under a bf16 cast, where the bf16 plan (from_pretrained's) does not."""
    if ZOO["t5"].expectation(BF16) is not None:
        pytest.skip("this Transformers keeps T5's wo at bf16 too: the plans do not differ")
    wrong, right = t5(), t5()
    fp16_plan = fp32keep.resolve_keep_plan(wrong, FP16)
    disguised = fp32keep.KeepPlan(**{**vars(fp16_plan), "dtype": BF16})  # what the check reads
    fp32keep.keep_aware_cast(wrong, BF16, plan=disguised)
    fp32keep.keep_aware_cast(right, BF16)
    assert wo_dtypes(wrong) == {FP32} and wo_dtypes(right) == {BF16}


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_the_plan_for_the_cast_dtype_is_accepted(dtype: torch.dtype) -> None:
    model = t5()
    fp32keep.keep_aware_cast(model, dtype, plan=fp32keep.resolve_keep_plan(model, dtype))
    expected = FP32 if ZOO["t5"].expectation(dtype) is not None else dtype
    assert wo_dtypes(model) == {expected}


@pytest.mark.parametrize(
    ("plan_dtype", "param_dtype", "stored", "refused"),
    [
        pytest.param(FP16, BF16, None, True, id="fp16-plan-bf16-policy-fp32-masters"),
        pytest.param(BF16, FP16, None, True, id="bf16-plan-fp16-policy-fp32-masters"),
        pytest.param(FP32, BF16, None, True, id="fp32-plan-bf16-policy"),
        pytest.param(FP16, BF16, BF16, True, id="fp16-plan-bf16-storage-bf16-policy"),
        pytest.param(FP16, BF16, FP16, False, id="storage-plan-bf16-compute"),  # Transformers'
        pytest.param(BF16, BF16, None, False, id="same"),
        pytest.param(FP16, FP16, None, False, id="same-fp16"),
        pytest.param(BF16, None, BF16, False, id="no-param-dtype"),
        pytest.param(FP16, None, FP16, False, id="no-param-dtype-fp16"),
        pytest.param(BF16, FP32, BF16, False, id="fp32-compute"),
    ],
)
def test_a_policy_computing_in_another_low_precision_dtype_is_refused(
    plan_dtype: torch.dtype,
    param_dtype: torch.dtype | None,
    stored: torch.dtype | None,
    refused: bool,
) -> None:
    """The rule (decided in plan_use.check_plan_for_policy's docstring): a policy whose
    ``param_dtype`` is fp16 or bf16 needs a plan for that dtype or for the low-precision dtype
    the model is stored in (``from_pretrained``'s; bf16 compute over fp16 storage, as
    Transformers' ``distributed_config`` runs); ``None`` or FP32 take any."""
    plan = fp32keep.resolve_keep_plan(t5(), plan_dtype)
    if not refused:
        check_plan_for_policy(plan, param_dtype, stored=stored)
        return
    with within(LIBRARY_BOUND_S), pytest.raises(KeepPlanError) as error:
        check_plan_for_policy(plan, param_dtype, stored=stored)
    assert f"resolved for {plan_dtype}" in str(error.value)
    assert f"mp_policy.param_dtype is {param_dtype}" in str(error.value)
