"""The keep-aware replacement for ``model.to(dtype)`` and the FP32 master-weight upcast."""

from __future__ import annotations

import torch
from torch import nn

from fp32keep._torch.modules import rebind_buffer
from fp32keep.errors import hidden_in_tracebacks
from fp32keep.plan.keep_plan import KeepPlan, resolve_keep_plan
from fp32keep.plan.use import check_plan_fits, check_plan_for_cast
from fp32keep.tensors import (
    check_float_dtype,
    check_module,
    is_castable_float,
    iter_owned,
    join,
)

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


@torch.no_grad()
def keep_aware_cast(
    model: nn.Module, dtype: torch.dtype, *, plan: KeepPlan | None = None
) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place, keeping the plan's tensors in FP32.

    The replacement for ``model.to(dtype)`` before sharding: kept floating parameters and
    buffers (every alias of a tied tensor) become or stay FP32, other floating tensors become
    ``dtype``, non-floating tensors (and packed float8/float4 quantized weights) are untouched.
    Parameter objects keep their identity (``param.data`` is replaced, as ``Module.to`` does),
    so optimizers and tied references stay valid.

    Args:
        model: the module to cast.
        dtype: the target dtype for tensors that are not kept.
        plan: a plan from :func:`resolve_keep_plan` for this model and ``dtype`` (keyword
            only); resolved for ``dtype`` when omitted.

    Returns:
        ``model``.

    Raises:
        KeepPlanError: ``plan`` was resolved for another dtype than ``dtype`` (the message
            names both), or names tensors ``model`` does not have. Checked before anything is
            cast.
        Fp32KeepTypeError / Fp32KeepValueError: ``dtype`` is not a floating torch dtype.
    """
    check_module(model, where="keep_aware_cast")
    check_float_dtype(dtype, what="dtype")
    if plan is None:
        plan = resolve_keep_plan(model, dtype)
    else:
        check_plan_for_cast(plan, dtype)
        check_plan_fits(model, plan)
    replaced: dict[int, torch.Tensor] = {}
    for module_fqn, module, attribute, tensor, is_param in iter_owned(model):
        if not is_castable_float(tensor.dtype):
            continue
        target = torch.float32 if join(module_fqn, attribute) in plan else dtype
        if is_param:
            if tensor.dtype != target and id(tensor) not in replaced:
                tensor.data = tensor.data.to(target)
                if tensor.grad is not None:
                    tensor.grad.data = tensor.grad.data.to(target)
            replaced[id(tensor)] = tensor
        else:
            # A buffer is rebound, not mutated: every alias must point at the one new tensor.
            if id(tensor) not in replaced:
                replaced[id(tensor)] = tensor.to(target) if tensor.dtype != target else tensor
            rebind_buffer(module, attribute, replaced[id(tensor)])
    return model


def _is_quantized(param: torch.Tensor) -> bool:
    # bitsandbytes' Params4bit stores packed uint8 (caught by the dtype test), but some versions
    # expose a float view; the class name and quant_state mark it either way.
    return (
        not is_castable_float(param.dtype)
        or type(param).__name__ == "Params4bit"
        or getattr(param, "quant_state", None) is not None
    )


@torch.no_grad()
def upcast_to_fp32_master(model: nn.Module) -> nn.Module:
    """Store every trainable floating parameter below FP32 as an FP32 master weight, in place.

    The fix from accelerate's FSDP2 report: a model whose units mix bf16 and fp32 trainable
    parameters dies on its first forward with ``FSDP expects uniform original parameter dtype``.
    Upcasting the trainable parameters *before* ``fully_shard`` makes every unit uniform, and the
    mixed-precision policy's ``param_dtype`` then casts for compute. The tensor's data is
    assigned (rebinding a loop variable would do nothing); frozen parameters, non-floating
    parameters and 4-bit/float8 quantized parameters are left alone. Kept parameters are FP32
    already, so this composes with :func:`keep_aware_cast`.

    Returns:
        ``model``.
    """
    check_module(model, where="upcast_to_fp32_master")
    for param in model.parameters():
        if not param.requires_grad or _is_quantized(param):
            continue
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)
    return model
