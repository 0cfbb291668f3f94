"""Whether a keep plan fits where it is used: the model, the cast's dtype, the policy's.

A plan answers "which tensors stay FP32 when *this model* runs in *this dtype*". Transformers
honours each keep list at some dtypes only (``_keep_in_fp32_modules`` at fp16 alone in 5.x), so
a plan resolved for fp16 and used for a bf16 cast would keep T5's ``wo`` in FP32 where
``from_pretrained(dtype=torch.bfloat16)`` does not, and the reverse would drop it. Each check
raises :class:`fp32keep.KeepPlanError` naming both sides and the fix, before anything changes.
"""

from __future__ import annotations

import torch
from torch import nn

from fp32keep.errors import KeepPlanError, hidden_in_tracebacks
from fp32keep.plan.compat import LOW_PRECISION_DTYPES
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.reprs import first_few
from fp32keep.tensors import dtype_name, tensor_slots

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


def check_plan_fits(model: nn.Module, plan: KeepPlan) -> None:
    """Raise :class:`fp32keep.KeepPlanError` when ``plan`` names tensors ``model`` lacks."""
    known = {name for slot in tensor_slots(model) for name in slot.names}
    unknown = sorted(plan.names - known)
    if unknown:
        raise KeepPlanError(
            f"the keep plan names tensors {type(model).__name__} does not have: "
            f"{first_few(unknown)}; resolve the plan on this model with "
            "fp32keep.resolve_keep_plan(model, dtype)"
        )


def check_plan_for_cast(plan: KeepPlan, dtype: torch.dtype) -> None:
    """Raise :class:`fp32keep.KeepPlanError` unless ``plan`` was resolved for ``dtype``.

    Exact: the cast stores what the plan does not keep in ``dtype``, so the plan must be the one
    for ``dtype`` (an FP32 cast with a bf16 plan changes nothing wrongly, but says the caller
    holds a plan for another run; it is refused too, so the rule has no exception to remember).
    """
    if plan.dtype != dtype:
        raise KeepPlanError(
            f"keep_aware_cast(dtype={dtype_name(dtype)}) was given a keep plan resolved for "
            f"{dtype_name(plan.dtype)}: which tensors stay FP32 depends on the dtype, so that "
            "plan keeps the wrong ones. Pass plan=fp32keep.resolve_keep_plan(model, "
            f"{dtype_name(dtype)}), or omit plan= to have it resolved for {dtype_name(dtype)}; "
            "nothing was cast"
        )


def storage_dtype(model: nn.Module, plan: KeepPlan) -> torch.dtype | None:
    """The low-precision dtype (fp16 or bf16) ``model`` stores the parameters ``plan`` does not
    keep in, or ``None`` where they are FP32 (master weights) or mixed."""
    stored = {
        param.dtype
        for name, param in model.named_parameters()
        if param.dtype in LOW_PRECISION_DTYPES and name not in plan
    }
    return stored.pop() if len(stored) == 1 else None


def check_plan_for_policy(
    plan: KeepPlan,
    param_dtype: torch.dtype | None,
    *,
    stored: torch.dtype | None = None,
    resolved_here: bool = False,
) -> None:
    """Raise :class:`fp32keep.KeepPlanError` when the plan was resolved for neither the
    low-precision dtype the model is stored in nor the one the policy computes in.

    Transformers resolves the keep lists for the dtype a checkpoint is loaded in
    (``from_pretrained(dtype=torch.float16)`` keeps T5's ``wo``), and its own FSDP2 then computes
    in whatever ``param_dtype`` its policy says (bf16 over fp16 storage): a plan for the storage
    dtype (``stored``, :func:`storage_dtype`) is right whatever the policy. Where nothing is
    stored in low precision (FP32 master weights), the policy's fp16 or bf16 ``param_dtype`` is
    the dtype the model runs in, and the plan must be resolved for it (a plan for fp16 under a
    bf16 policy, or one for FP32, which keeps nothing the strict list names, is refused).
    ``param_dtype`` ``None`` or FP32 names no low-precision dtype: any plan is accepted, the
    storage having been cast with it (:func:`check_plan_for_cast`). ``resolved_here``: the plan
    was resolved from the model's storage because the caller gave none; the message says so.
    """
    if param_dtype not in LOW_PRECISION_DTYPES or plan.dtype in (param_dtype, stored):
        return
    assert param_dtype is not None  # in LOW_PRECISION_DTYPES
    origin = (
        "resolved from the model's storage dtype (no plan= was given)"
        if resolved_here
        else "resolved"
    )
    storage = (
        f"the model's other parameters are stored in {dtype_name(stored)}"
        if stored is not None
        else "nothing is stored in low precision (FP32 master weights)"
    )
    raise KeepPlanError(
        f"apply_fsdp2: the keep plan was {origin} for {dtype_name(plan.dtype)}, but "
        f"mp_policy.param_dtype is {dtype_name(param_dtype)} and {storage}: which tensors "
        "stay FP32 depends on the dtype the model is loaded or computes in. Resolve the plan "
        f"for it, plan=fp32keep.resolve_keep_plan(model, {dtype_name(param_dtype)}), and cast "
        f"with the same dtype (fp32keep.keep_aware_cast(model, {dtype_name(param_dtype)}, "
        "plan=plan)), or use a policy whose param_dtype is the plan's; nothing was sharded"
    )
