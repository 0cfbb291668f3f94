"""The storage convention the contract judges by: low-precision storage, or FP32 master weights.

``master_dtype=None`` (the default): every floating tensor the plan does not keep is stored in
the low-precision ``dtype``, as after ``fp32keep.keep_aware_cast``. ``master_dtype=torch.float32``:
FP32 master weights, what accelerate, verl's default and torchtitan do: every trainable parameter
is stored in FP32 and the FSDP2 policy's ``param_dtype`` casts it for compute; frozen parameters
and buffers the plan does not keep are stored in ``dtype`` (accelerate) or FP32 (verl's
``module.to(torch.float32)``), whichever the implementation chose (:mod:`.follow`: the reference
makes the same choice before :func:`expected_storage` reads it). Kept tensors are FP32 under
both, and are judged by the Hugging Face contract either way.

The unsharded reference is cast keep-aware to ``dtype`` under both conventions, then holds each
parameter in the dtype it computes in (:mod:`.policy`): a correct FSDP2 run all-gathers
``param_dtype(stored)``, which is exactly the reference's tensor (an FP32 master holds the
``dtype`` values of the checkpoint, upcast exactly), so forward is bit-identical; gradients then
land in the dtype each parameter is stored in (:func:`~.policy.expected_grads`).
"""

from __future__ import annotations

import torch
from torch import nn

from fp32keep import KeepPlan

__all__ = ["MASTER_DTYPES", "expected_storage", "validate_master_dtype"]

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
