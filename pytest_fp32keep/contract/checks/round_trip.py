"""The ``round trip`` item: a low-precision full state dict loads and gathers back exactly."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

import fp32keep
from pytest_fp32keep.contract.probe import dtype_name
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.steps import LoadFn, local


def check_round_trip(
    model: nn.Module, pristine: Mapping[str, torch.Tensor], dtype: torch.dtype, load: LoadFn
) -> list[Finding]:
    """Load ``pristine`` cast to ``dtype``, gather it back: exact, in each destination dtype."""
    # A low-precision checkpoint: kept tensors arrive in `dtype` and must land in FP32.
    checkpoint = {name: t.to(dtype) if t.is_floating_point() else t for name, t in pristine.items()}
    destination = {name: local(t).dtype for name, t in model.state_dict().items()}
    load(model, checkpoint if dist.get_rank() == 0 else None)
    gathered = fp32keep.gather_full_state_dict(model)
    findings: list[Finding] = []
    for name, want_dtype in destination.items():
        got = gathered.get(name)
        if got is None:
            findings.append(Finding("round trip", name, dtype_name(want_dtype), "missing", False))
            continue
        expected = checkpoint[name].to(want_dtype)
        exact = got.dtype == want_dtype and torch.equal(got.cpu(), expected.cpu())
        observed = dtype_name(got.dtype) + (
            "" if exact or got.dtype != want_dtype else " (values differ)"
        )
        findings.append(Finding("round trip", name, dtype_name(want_dtype), observed, exact))
    return findings
