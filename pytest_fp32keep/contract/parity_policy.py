"""How far each gradient may be from the reference's before it breaks parity.

It owns the measure (:func:`relative_error`: a gradient's largest difference relative to its own
scale), the control's errors (:func:`control_errors`: how far each gradient of the control —
:mod:`.control`: the implementation's own units at the same world size, sharded with the
correct policy — lands from the reference), and the policy that turns them into one bound per
parameter (:func:`gradient_bounds`, :data:`CONTROL_ERROR_LIMIT`). The argument is written down
in ``docs/contract.md``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import torch

from pytest_fp32keep.contract.report import Finding

CONTROL_ERROR_LIMIT = 0.05
"""The most the control's *median* gradient may be off the unsharded model's (relative to each
gradient's scale) for its errors to serve as bounds. A few gradients far off are noise (a key
bias's gradient is zero in exact arithmetic, so all of it is roundoff); most of them far off
means FSDP2 itself is wrong on this torch and backend (torch 2.7 on gloo sums gradients over the
ranks instead of averaging them: every gradient 2x), and widening the bounds to match would let
any bug of the same size pass."""


def relative_error(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest gradient difference relative to the gradient's own scale.

    Scale-relative rather than per-element or per-ulp: near-zero elements would inflate a
    per-element ratio, and counting ulps would punish an FP32 gradient (kept) against a bf16 one
    for its finer grid.
    """
    if observed.shape != expected.shape:
        return float("inf")
    if not expected.numel():
        return 0.0
    scale = float(expected.double().abs().max())
    diff = float((observed.double() - expected.double()).abs().max())
    return diff / scale if scale else diff


def control_errors(
    control: Mapping[str, torch.Tensor | None], reference: Mapping[str, torch.Tensor | None]
) -> dict[str, float]:
    """Each gradient's :func:`relative_error` in the control against the reference's (``inf``
    where the control has none)."""
    errors: dict[str, float] = {}
    for name, want in reference.items():
        if want is None:
            continue
        got = control.get(name)
        errors[name] = float("inf") if got is None else relative_error(got, want)
    return errors


def gradient_bounds(
    control: Mapping[str, float] | str,
) -> tuple[dict[str, float], list[Finding], list[str]]:
    """How far each gradient may be from the reference's, given the control's errors.

    ``control`` maps each parameter to how far the control's gradient lands from the reference
    (:func:`control_errors`), or says why the control could not run. Each parameter's bound is
    the control's own error for it: 0 (bit-identical required) wherever the control reproduces
    the reference exactly. A control that failed, or whose median gradient is off by more than
    :data:`CONTROL_ERROR_LIMIT`, is itself a finding (FSDP2 does not reproduce the model on
    this torch and backend), and then no bound is widened: every bound is 0.

    Returns:
        the bound per parameter, findings about the control, notes for the report.
    """
    if isinstance(control, str):
        observed = control
    else:
        typical = statistics.median(control.values()) if control else 0.0
        if typical <= CONTROL_ERROR_LIMIT:
            inexact = {name: error for name, error in control.items() if error}
            worst = max(inexact.values(), default=0.0)
            note = (
                "control (the implementation's units, this world size, the correct policy): "
                f"{len(inexact)} of {len(control)} gradient(s) not bit-identical to the "
                f"reference, at most {worst:.3g} relative; each such gradient is bounded by "
                "the control's own error, every other must be bit-identical"
            )
            return dict(control), [], [note]
        observed = f"median {typical:.3g} relative over {len(control)} gradients"
    finding = Finding(
        "parity",
        "control (same units, correct policy)",
        f"median <= {CONTROL_ERROR_LIMIT:g} relative to the unsharded model",
        observed,
        False,
    )
    note = (
        "the control does not reproduce the unsharded model here "
        f"({observed}): the installed torch's FSDP2 is wrong for this model or backend (torch "
        "2.7 on gloo, for one, sums gradients over the ranks instead of averaging them), so "
        "every gradient must be bit-identical."
    )
    return {}, [finding], [note]
