"""How far each gradient may be from the reference's before it breaks parity.

It owns the measure (:func:`relative_error`: a gradient's largest difference relative to its own
scale), the control's errors (:func:`control_errors`: how far each gradient of the control —
:mod:`.control`: the implementation's own units at the same world size, sharded with the
correct policy — lands from the reference), how far two runs of the control differ where the
runs are not known to be deterministic (:func:`control_spread`), and the policy that turns them
into one bound per parameter (:func:`gradient_bounds`, :data:`CONTROL_ERROR_LIMIT`). The
argument is written down in ``docs/contract.md``.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class ControlMeasure:
    """What the parity control measured.

    Attributes:
        errors: each gradient's :func:`relative_error` against the reference (first run).
        spread: where the control ran twice, each gradient's :func:`control_spread`; ``None``
            where one run was enough (every run known to be deterministic).
        why_twice: why it ran twice (the operators torch could not make deterministic, a CUDA
            run, or ``measure_spread=True``).
        notes: what else the report should say about the control.
    """

    errors: Mapping[str, float]
    spread: Mapping[str, float] | None = None
    why_twice: str = ""
    notes: tuple[str, ...] = ()


def relative_error(
    observed: torch.Tensor, expected: torch.Tensor, scale_of: torch.Tensor | None = None
) -> float:
    """Largest gradient difference relative to the gradient's own scale (the largest magnitude
    of ``scale_of``, by default ``expected``).

    Scale-relative rather than per-element or per-ulp: near-zero elements would inflate a
    per-element ratio, and counting ulps would punish an FP32 gradient (kept) against a bf16 one
    for its finer grid.
    """
    if observed.shape != expected.shape:
        return float("inf")
    if not expected.numel():
        return 0.0
    scale = float((expected if scale_of is None else scale_of).double().abs().max())
    diff = float((observed.double() - expected.double()).abs().max())
    return diff / scale if scale else diff


def control_spread(
    first: Mapping[str, torch.Tensor | None],
    second: Mapping[str, torch.Tensor | None],
    reference: Mapping[str, torch.Tensor | None],
) -> dict[str, float]:
    """How far each gradient of two control runs differ, relative to the reference gradient's
    scale (the scale its bound is measured in); ``inf`` where one run has it and the other not.

    A correct implementation's gradient is one more draw of what the control computes, so it
    lies within ``error + spread`` of the reference (triangle inequality), where two draws
    show the spread.
    """
    spread: dict[str, float] = {}
    for name, want in reference.items():
        if want is None:
            continue
        a, b = first.get(name), second.get(name)
        if a is None or b is None:
            spread[name] = 0.0 if a is None and b is None else float("inf")
            continue
        spread[name] = relative_error(b, a, scale_of=want)
    return spread


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
    control: ControlMeasure | Mapping[str, float] | str,
) -> tuple[dict[str, float], list[Finding], list[str]]:
    """How far each gradient may be from the reference's, given what the control measured.

    ``control`` is the control's :class:`ControlMeasure` (or just its errors,
    :func:`control_errors`), or says why the control could not run. Each parameter's bound is
    the control's own error for it, plus, where the control ran twice, the spread of its two
    runs for it: 0 (bit-identical required) wherever the control reproduces the reference
    exactly and reproduces itself. A control that failed, or whose median gradient is off by more
    than :data:`CONTROL_ERROR_LIMIT`, is itself a finding (FSDP2 does not reproduce the model on
    this torch and backend), and then no bound is widened: every bound is 0.

    Returns:
        the bound per parameter, findings about the control, notes for the report.
    """
    if isinstance(control, str):
        return _broken(control)
    measure = control if isinstance(control, ControlMeasure) else ControlMeasure(control)
    errors = measure.errors
    typical = statistics.median(errors.values()) if errors else 0.0
    if typical > CONTROL_ERROR_LIMIT:
        return _broken(f"median {typical:.3g} relative over {len(errors)} gradients")
    inexact = {name: error for name, error in errors.items() if error}
    worst = max(inexact.values(), default=0.0)
    notes = [
        "control (the implementation's units, this world size, the correct policy): "
        f"{len(inexact)} of {len(errors)} gradient(s) not bit-identical to the "
        f"reference, at most {worst:.3g} relative; each such gradient is bounded by "
        "the control's own error, every other must be bit-identical",
        *measure.notes,
    ]
    bounds = dict(errors)
    if measure.spread is not None:
        differ = {name: spread for name, spread in measure.spread.items() if spread}
        for name, spread in differ.items():
            bounds[name] = bounds.get(name, 0.0) + spread
        notes.append(_spread_note(measure.why_twice, differ, len(measure.spread)))
    return bounds, [], notes


def _spread_note(why: str, differ: Mapping[str, float], total: int) -> str:
    if not differ:
        return (
            f"control reproducible: its two runs ({why}) are bit-identical in all {total} "
            "gradient(s); no bound widened"
        )
    shown = ", ".join(sorted(differ)[:3]) + (" …" if len(differ) > 3 else "")
    return (
        f"control not reproducible ({why}): {len(differ)} of {total} gradient(s) differ "
        f"between two control runs, at most {max(differ.values()):.3g} relative ({shown}); "
        "each of them may be that much further off (its bound is the control's error plus the "
        "spread)"
    )


def _broken(observed: str) -> tuple[dict[str, float], list[Finding], list[str]]:
    """A control that crashed or does not reproduce the unsharded model: a failing finding."""
    finding = Finding(
        "parity",
        "control (same units, correct policy)",
        f"median <= {CONTROL_ERROR_LIMIT:g} relative to the unsharded model",
        observed,
        False,
    )
    note = (
        "the control (the implementation's units sharded with the correct policy) does not "
        f"reproduce the unsharded model here ({observed}), so no gradient may be off: every "
        "gradient must be bit-identical. Where the contract's defaults (fp32keep's own path) "
        "fail the same way on the same model and torch, FSDP2 itself does not reproduce the "
        "model there (torch 2.7 on gloo, for one, sums gradients over the ranks instead of "
        "averaging them)."
    )
    return {}, [finding], [note]
