"""The ``stored`` and ``materialized`` items: each tensor's dtype at rest and when all-gathered."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep import KeepPlan
from pytest_fp32keep.contract.probe import DtypeProbe, dtype_name
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.steps import local


def check_stored(
    model: nn.Module, expected: Mapping[str, torch.dtype], plan: KeepPlan
) -> list[Finding]:
    """Every floating parameter's local shard and buffer of ``model`` is stored as ``expected``
    says (:func:`~pytest_fp32keep.contract.master.expected_storage`: kept tensors FP32, the rest
    as the storage convention prescribes, read off the reference and the plan, never off the
    model under test); a floating tensor the convention does not know is a failing finding."""
    findings: list[Finding] = []
    observed: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    observed.update(model.named_buffers(remove_duplicate=False))
    for name, tensor in observed.items():
        if not tensor.is_floating_point():
            continue
        want = expected.get(name)
        got = local(tensor).dtype
        if want is None:  # the implementation added a tensor the model does not have
            findings.append(Finding("stored", name, "absent", dtype_name(got), False))
            continue
        if name in plan or got != want:
            findings.append(Finding("stored", name, dtype_name(want), dtype_name(got), got == want))
    return findings


def check_materialized(
    probe: DtypeProbe, model: nn.Module, plan: KeepPlan, policy: MixedPrecisionPolicy
) -> tuple[list[Finding], dict[str, str]]:
    """Kept parameters are all-gathered in FP32, the rest in the policy's ``param_dtype``.

    Returns:
        the findings, and the dtype each parameter was first seen all-gathered in.
    """
    findings: list[Finding] = []
    seen: dict[str, str] = {}
    storage = {name: local(p).dtype for name, p in model.named_parameters(remove_duplicate=False)}
    for record in probe.param_records:
        name = f"{record.fqn}.{record.name}" if record.fqn else record.name
        if name not in storage or not record.dtype.is_floating_point:
            continue
        if name in plan:
            want = torch.float32
        elif policy.param_dtype is not None:
            want = policy.param_dtype  # exactly what plain FSDP2 gives the rest
        else:
            want = storage[name]
        seen.setdefault(name, dtype_name(record.dtype))
        if name in plan or record.dtype != want:
            findings.append(
                Finding(
                    "materialized",
                    f"{name} (call {record.call})",
                    dtype_name(want),
                    dtype_name(record.dtype) + (" (still sharded)" if record.sharded else ""),
                    record.dtype == want and not record.sharded,
                )
            )
    return findings, seen
