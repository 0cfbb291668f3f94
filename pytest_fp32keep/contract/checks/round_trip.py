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
    model: nn.Module,
    checkpoint: Mapping[str, torch.Tensor],
    load: LoadFn,
    expected: Mapping[str, torch.dtype],
    *,
    every_rank: bool = False,
) -> list[Finding]:
    """Load a fresh copy of ``checkpoint`` with ``load``, gather it back: exact, in each
    destination dtype (kept tensors arrive in the low-precision dtype and must land in FP32;
    under FP32 master weights every trainable parameter too).

    The destination dtype of each entry is the storage convention's (``expected``:
    :func:`~pytest_fp32keep.contract.master.expected_storage`), never the dtype the
    implementation under test happens to store it in: a model cast wrong would otherwise be
    judged by its own mistake. An entry the convention does not know (an integer buffer, a
    tensor the implementation added) keeps the model's dtype.

    ``load`` gets a copy made for it alone (rank 0, ``None`` elsewhere; every rank with
    ``every_rank``, for loaders that read the whole dict on each rank), never read again: a
    loader may rewrite the mapping it is given (torch DCP's ``set_model_state_dict`` with
    ``broadcast_from_rank0=True`` puts DTensors in it). ``checkpoint`` itself is only read.
    """
    destination = {
        name: expected.get(name, local(t).dtype) for name, t in model.state_dict().items()
    }
    source = every_rank or dist.get_rank() == 0
    handed = {name: t.clone() for name, t in checkpoint.items()} if source else None
    load(model, handed)
    del handed
    gathered = fp32keep.gather_full_state_dict(model)
    findings: list[Finding] = []
    for name, want_dtype in destination.items():
        got = gathered.get(name)
        if got is None:
            findings.append(Finding("round trip", name, dtype_name(want_dtype), "missing", False))
            continue
        want = checkpoint[name].to(want_dtype)
        exact = got.dtype == want_dtype and torch.equal(got.cpu(), want.cpu())
        observed = dtype_name(got.dtype) + (
            "" if exact or got.dtype != want_dtype else " (values differ)"
        )
        findings.append(Finding("round trip", name, dtype_name(want_dtype), observed, exact))
    return findings
