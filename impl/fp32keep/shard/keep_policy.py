"""Keeping FP32 by policy: torch 2.15's per-parameter ``param_dtype_override_fn``.

From torch 2.15, ``MixedPrecisionPolicy(param_dtype_override_fn=fn)`` lets one FSDP2 unit
all-gather some of its parameters in their own dtype while the rest compute in ``param_dtype``.
Under FP32 master weights (every trainable parameter stored in FP32: accelerate, verl's default,
torchtitan, nemo-automodel's recommended config) that keeps the plan's parameters FP32 inside the
caller's own units, one block one unit, with no unit of fp32keep's and no extra collective:
:func:`keep_policy` is that policy, and :func:`policy_blocker` says where it cannot be right.

It cannot be where

* the installed torch has no ``param_dtype_override_fn`` (before 2.15);
* a trainable parameter is stored in fp16 or bf16 beside a kept FP32 one: FSDP2 asserts one
  original dtype per unit, override or not (low-precision storage needs kept units of their own,
  :func:`fp32keep.apply_fsdp2`'s default layout);
* the policy reduces gradients below 32 bits: one unit reduces all its gradients in one dtype,
  and a kept parameter's FP32 gradient averaged in bf16 loses its low bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep.errors import (
    Fp32KeepNotImplementedError,
    Fp32KeepValueError,
    hidden_in_tracebacks,
)
from fp32keep.plan.compat import LOW_PRECISION_DTYPES
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.plan.use import check_plan_fits
from fp32keep.reprs import first_few
from fp32keep.tensors import dtype_name

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

OVERRIDE_SUPPORTED = "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(MixedPrecisionPolicy)
}
"""Whether the installed torch has ``MixedPrecisionPolicy.param_dtype_override_fn`` (2.15+)."""


def _torch_blocker() -> str | None:
    if OVERRIDE_SUPPORTED:
        return None
    return (
        f"torch {torch.__version__} has no MixedPrecisionPolicy.param_dtype_override_fn "
        "(torch 2.15 added it)"
    )


def reduces_below_fp32(mp_policy: MixedPrecisionPolicy) -> bool:
    """Whether ``mp_policy`` reduces gradients in fewer than 32 bits: kept FP32 gradients
    averaged in bf16 would lose their low bits (a kept unit drops such a ``reduce_dtype``; the
    policy path cannot)."""
    reduce_dtype = mp_policy.reduce_dtype
    return reduce_dtype is not None and torch.finfo(reduce_dtype).bits < 32


def _reduce_blocker(mp_policy: MixedPrecisionPolicy) -> str | None:
    reduce_dtype = mp_policy.reduce_dtype
    if reduce_dtype is None or not reduces_below_fp32(mp_policy):
        return None
    return (
        f"the policy reduces gradients in {dtype_name(reduce_dtype)}: a unit reduces all its "
        "gradients in one dtype, so kept FP32 gradients would lose their low bits (pass "
        "reduce_dtype=torch.float32)"
    )


def _storage_blocker(model: nn.Module) -> str | None:
    low = sorted(
        name
        for name, param in model.named_parameters()
        if param.requires_grad and param.dtype in LOW_PRECISION_DTYPES
    )
    if not low:
        return None
    return (
        f"trainable parameters are stored in low precision ({first_few(low)}): FSDP2 "
        "needs one original dtype per unit, so kept FP32 parameters cannot share units with "
        "them (FP32 master weights, fp32keep.upcast_to_fp32_master, lift this)"
    )


def policy_blocker(model: nn.Module, mp_policy: MixedPrecisionPolicy) -> str | None:
    """Why :func:`keep_policy` cannot keep a plan in ``model``'s own units under ``mp_policy``
    (the installed torch, the reduce dtype, the storage), or ``None`` when it can: what
    :func:`fp32keep.apply_fsdp2` checks before it chooses the policy over kept units."""
    return _torch_blocker() or _reduce_blocker(mp_policy) or _storage_blocker(model)


def keep_policy(
    mp_policy: MixedPrecisionPolicy, plan: KeepPlan, model: nn.Module
) -> MixedPrecisionPolicy:
    """``mp_policy`` with a ``param_dtype_override_fn`` that all-gathers the plan's parameters of
    ``model`` in FP32 (their storage dtype) whatever ``param_dtype`` says; every other parameter
    gets what the caller's own override (if any) or ``param_dtype`` gives it.

    For the caller's own units over FP32 master weights, on torch 2.15 or later: shard every unit
    with it (``fully_shard(block, mp_policy=keep_policy(policy, plan, model))``), and the kept
    parameters stay FP32 in forward and backward, reduced in the policy's ``reduce_dtype``. The
    policy's boundary casts are the caller's: ``cast_forward_inputs=True`` still casts the FP32
    activations a kept module hands to the next unit (T5's residual after ``wo``) to
    ``param_dtype``, as plain FSDP2 does; pass ``cast_forward_inputs=False`` to keep them, as the
    unsharded model does. Kept parameters are recognised by identity: call it on the model you
    shard, after any cast (which keeps identity) and before ``fully_shard``.

    Raises:
        Fp32KeepNotImplementedError: the installed torch has no ``param_dtype_override_fn``.
        Fp32KeepValueError: the policy reduces below 32 bits, or a kept parameter is not stored
            in FP32 (cast with :func:`fp32keep.keep_aware_cast` first). Nothing is changed.
        KeepPlanError: ``plan`` names tensors ``model`` does not have.
    """
    if not OVERRIDE_SUPPORTED:
        raise Fp32KeepNotImplementedError(
            f"keep_policy: torch {torch.__version__} has no "
            "MixedPrecisionPolicy.param_dtype_override_fn (torch 2.15 added it); keep the plan "
            "with kept units instead: fp32keep.apply_fsdp2(model, mesh=..., mp_policy=..., "
            "plan=...)"
        )
    check_plan_fits(model, plan)
    reduce_blocker = _reduce_blocker(mp_policy)
    if reduce_blocker is not None:
        raise Fp32KeepValueError(f"keep_policy: {reduce_blocker}")
    named = list(model.named_parameters(remove_duplicate=False))
    kept = [param for name, param in named if name in plan]
    degraded = sorted(
        name for name, param in named if name in plan and param.dtype != torch.float32
    )
    if degraded:
        raise Fp32KeepValueError(
            f"keep_policy: kept parameters are not stored in FP32 ({first_few(degraded)}): "
            "the override keeps a parameter in its own dtype only; cast with "
            "fp32keep.keep_aware_cast(model, dtype, plan=plan) first"
        )
    # the field exists on torch >= 2.15 only (OVERRIDE_SUPPORTED), so it is passed by name
    callers = getattr(mp_policy, "param_dtype_override_fn", None)
    override: dict[str, Any] = {"param_dtype_override_fn": _keeping(kept, callers)}
    return dataclasses.replace(mp_policy, **override)


def _keeping(
    kept: list[nn.Parameter],
    callers: Callable[[nn.Parameter], torch.dtype | None] | None,
) -> Callable[[nn.Parameter], torch.dtype | None]:
    """The override: FP32 for the ``kept`` parameters (held by the closure, so their ids stay
    theirs), else the caller's own override's answer."""
    by_id = {id(param): param for param in kept}

    def override(param: nn.Parameter) -> torch.dtype | None:
        if id(param) in by_id:
            return torch.float32
        return callers(param) if callers is not None else None

    return override


KeepBy = Literal["auto", "units", "policy"]
"""How :func:`fp32keep.apply_fsdp2` keeps the plan: ``"units"`` (kept units of their own),
``"policy"`` (the caller's units, :func:`keep_policy`), ``"auto"`` (the policy where it can keep
the plan, else units)."""

KEEP_BY: tuple[KeepBy, ...] = ("auto", "units", "policy")


def choose_keeping(
    model: nn.Module,
    plan: KeepPlan,
    mp_policy: MixedPrecisionPolicy,
    *,
    keep_by: object,
    grouped: bool,
) -> tuple[Literal["units", "policy"], str]:
    """How to keep ``plan`` (``keep_by`` as :func:`fp32keep.apply_fsdp2` was given it) and why.

    ``"auto"`` takes the policy, the lighter fix (no unit or collective of fp32keep's), wherever
    it keeps the plan: something kept, a low-precision ``param_dtype`` to keep it from, no
    ``group_kept`` asked for, and no :func:`policy_blocker`.

    Raises:
        Fp32KeepValueError: ``keep_by`` is not one of :data:`KEEP_BY`, or is ``"policy"`` where
            :func:`policy_blocker` says the policy cannot keep the plan (naming why).
    """
    if keep_by not in KEEP_BY:
        raise Fp32KeepValueError(
            f"apply_fsdp2(keep_by={keep_by!r}): expected one of {', '.join(map(repr, KEEP_BY))}"
        )
    if keep_by == "units":
        return "units", "keep_by='units'"
    if keep_by == "policy":
        blocker = policy_blocker(model, mp_policy)
        if blocker is not None:
            raise Fp32KeepValueError(
                f"apply_fsdp2(keep_by='policy') cannot keep the plan by the policy: {blocker}; "
                "pass keep_by='units' (or 'auto') for kept units; nothing was sharded"
            )
        return "policy", "keep_by='policy'"
    if plan.is_empty:
        return "units", "nothing is kept"
    if mp_policy.param_dtype not in LOW_PRECISION_DTYPES:
        return "units", "the policy has no low-precision param_dtype to keep them from"
    if grouped:
        return "units", "group_kept asks for kept units"
    blocker = policy_blocker(model, mp_policy)  # scans the parameters: after the cheap answers
    if blocker is not None:
        return "units", blocker
    return "policy", (
        "torch has param_dtype_override_fn and every trainable parameter is stored in FP32"
    )
