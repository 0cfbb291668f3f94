"""The storage convention the contract judges by: low-precision storage, or FP32 master weights.

``master_dtype=None`` (the default): every floating tensor the plan does not keep is stored in
the low-precision ``dtype``, as after ``fp32keep.keep_aware_cast``. ``master_dtype=torch.float32``:
FP32 master weights, what accelerate, verl's default and torchtitan do: every trainable parameter
is stored in FP32 and the FSDP2 policy's ``param_dtype`` casts it for compute; frozen parameters
and buffers stay as under the default. Kept tensors are FP32 under both, and are judged by the
Hugging Face contract either way.

The unsharded reference is the same under both conventions: a model cast keep-aware to
``dtype``. Under FP32 master weights it is the *compute copy*: a correct FSDP2 run all-gathers
``param_dtype(master)``, which is exactly the reference's ``dtype`` tensor (the master holds the
pristine FP32 weights, the reference their cast), so forward is bit-identical; gradients then
land in the master's FP32, and :func:`as_master_grads` says what they must equal.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fp32keep import KeepPlan

__all__ = ["MASTER_DTYPES", "as_master_grads", "expected_storage", "validate_master_dtype"]

MASTER_DTYPES: tuple[torch.dtype | None, ...] = (None, torch.float32)
"""The storage conventions the contract knows: ``None`` (low precision) and FP32 master weights."""


def validate_master_dtype(master_dtype: object) -> torch.dtype | None:
    """``master_dtype`` if it is one the contract knows; else a ``ValueError`` saying which are."""
    if master_dtype is None or master_dtype is torch.float32:
        return master_dtype
    raise ValueError(
        f"assert_fp32_keep_contract(master_dtype={master_dtype!r}): unsupported master dtype; "
        "pass None (parameters the plan does not keep are stored in `dtype`) or torch.float32 "
        "(FP32 master weights: every trainable parameter stored in FP32, the policy's "
        "param_dtype casts for compute)"
    )


def expected_storage(
    reference: nn.Module, plan: KeepPlan, master_dtype: torch.dtype | None
) -> dict[str, torch.dtype]:
    """The dtype each floating parameter and buffer (every alias) must be stored in."""
    expected: dict[str, torch.dtype] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        if not param.is_floating_point():
            continue
        if name in plan:
            expected[name] = torch.float32
        elif master_dtype is not None and param.requires_grad:
            expected[name] = master_dtype
        else:
            expected[name] = param.dtype
    for name, buffer in reference.named_buffers(remove_duplicate=False):
        if buffer.is_floating_point():
            expected[name] = torch.float32 if name in plan else buffer.dtype
    return expected


def as_master_grads(
    grads: Mapping[str, torch.Tensor | None], plan: KeepPlan, master_dtype: torch.dtype | None
) -> dict[str, torch.Tensor | None]:
    """The reference's gradients as FP32 master weights must hold them.

    FSDP2 computes a master-weight parameter's unsharded gradient in ``param_dtype``, reduces it
    in ``reduce_dtype`` and stores it in the parameter's FP32; the reference's ``dtype``
    gradient, upcast (exact), is what that yields wherever the reduction is exact.
    """
    if master_dtype is None:
        return dict(grads)
    return {
        name: grad
        if grad is None or name in plan or not grad.is_floating_point()
        else grad.to(master_dtype)
        for name, grad in grads.items()
    }
