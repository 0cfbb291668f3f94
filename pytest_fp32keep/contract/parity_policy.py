"""How far a gradient may be from the reference's before it breaks parity.

It owns the measure (:func:`relative_error`: a gradient's largest difference relative to its own
scale), the control run (:func:`control_error`: how far plain FSDP2 with nothing kept lands from
its own unsharded reference), and the policy that turns the control into a bound
(:func:`gradient_bound`, :data:`GRADIENT_NOISE_ULPS`, :data:`CONTROL_ERROR_LIMIT`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep
from fp32keep.layout import WrapSpec
from pytest_fp32keep.contract.reference import build_unsharded_reference, seeded
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.steps import device_of, forward_backward

GRADIENT_NOISE_ULPS = 2
"""Accumulation-order noise allowed, in units of the low-precision dtype's roundoff (see parity)."""

CONTROL_ERROR_LIMIT = 0.05
"""The most plain FSDP2's *median* gradient may be off the unsharded model's (relative to each
gradient's scale) for its errors to serve as the noise bound. A few gradients far off are noise
(a key bias's gradient is zero in exact arithmetic, so all of it is roundoff); most of them far
off means plain FSDP2 itself is wrong on this torch and backend (torch 2.7 on gloo sums gradients
over the ranks instead of averaging them: every gradient 2x), and widening the bound to match
would let any bug of the same size pass."""


def relative_error(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest gradient difference relative to the gradient's own scale.

    Scale-relative rather than per-element or per-ulp: near-zero elements would inflate a
    per-element ratio, and counting ulps would punish an FP32 gradient (kept) against a bf16 one
    (the control) for its finer grid.
    """
    if observed.shape != expected.shape:
        return float("inf")
    if not expected.numel():
        return 0.0
    scale = float(expected.double().abs().max())
    diff = float((observed.double() - expected.double()).abs().max())
    return diff / scale if scale else diff


def control_error(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    *,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    policy: MixedPrecisionPolicy,
    wrap: WrapSpec | None,
    autocast: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    seed: int,
) -> list[float]:
    """How far each gradient of plain FSDP2 (nothing kept, same policy) lands from its own
    unsharded reference, relative to the gradient's scale."""
    device = device_of(mesh)
    with seeded(seed):
        model = model_factory().to(device=device, dtype=dtype)
    reference = build_unsharded_reference(model)
    # With nothing kept, apply_fsdp2 is plain FSDP2 over the same units.
    nothing_kept = fp32keep.resolve_keep_plan(model, torch.float32)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=nothing_kept, wrap=wrap)
    observed = forward_backward(
        model, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )
    expected = forward_backward(
        reference, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )
    errors: list[float] = []
    for name, want in expected.grads.items():
        got = observed.grads.get(name)
        if want is not None and got is not None:
            errors.append(relative_error(got, want))
    return errors


def gradient_bound(
    control: Sequence[float] | str, dtype: torch.dtype
) -> tuple[float, list[Finding], list[str]]:
    """How far keep-aware gradients may be from the unsharded model's, given the control.

    ``control`` is how far each gradient of plain FSDP2 with nothing kept lands from its own
    unsharded reference (relative), or why it could not run. Plain FSDP2 bit-identical: any
    difference is ours (bound 0). Off by noise: both runs carry accumulation-order noise, bounded
    by the larger of plain FSDP2's worst gradient and ``GRADIENT_NOISE_ULPS`` roundoffs of
    ``dtype``. A control that failed, or whose median gradient is off by more than
    :data:`CONTROL_ERROR_LIMIT`, is itself a finding (the installed torch's FSDP2 does not
    reproduce the model on this backend), and the bound stays at the roundoff one.

    Returns:
        the bound, findings about the control, notes for the report.
    """
    roundoff = GRADIENT_NOISE_ULPS * torch.finfo(dtype).eps
    if isinstance(control, str):
        observed = control
    else:
        worst, typical = max(control, default=0.0), statistics.median(control or [0.0])
        if typical <= CONTROL_ERROR_LIMIT:
            bound = max(worst, roundoff) if worst else 0.0
            note = f"plain FSDP2 with nothing kept: at most {worst:.3g} (median {typical:.3g})"
            return bound, [], [note + " from its reference"]
        observed = f"median {typical:.3g} relative over {len(control)} gradients"
    finding = Finding(
        "parity",
        "plain FSDP2 control (nothing kept)",
        f"median <= {CONTROL_ERROR_LIMIT:g} relative to the unsharded model",
        observed,
        False,
    )
    note = (
        "plain FSDP2 with nothing kept does not reproduce the unsharded model here "
        f"({observed}): the installed torch's FSDP2 is wrong for this model or backend (torch "
        "2.7 on gloo, for one, sums gradients over the ranks instead of averaging them), so "
        f"gradient parity is judged against roundoff alone ({roundoff:.3g})."
    )
    return roundoff, [finding], [note]
