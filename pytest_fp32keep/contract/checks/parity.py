"""The ``parity`` item: logits, loss and every gradient against the unsharded reference's.

Logits and loss must be bit-identical. Each gradient must be too, unless the control (the
implementation's own units at the same world size, sharded with the correct policy:
:mod:`pytest_fp32keep.contract.control`) is not bit-identical for that parameter either: then it
may be as far off as the control is, plus, where the runs are not known to be deterministic, as
far as two control runs differ (:mod:`pytest_fp32keep.contract.parity_policy`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pytest_fp32keep.contract.parity_policy import (
    ControlMeasure,
    gradient_bounds,
    relative_error,
)
from pytest_fp32keep.contract.probe import dtype_name
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.steps import Run

FORWARD_ONLY = (
    "forward only: no parameter requires a gradient (a frozen model, such as a reference or "
    "teacher model), so no backward ran; gradients, their reduction and the control were not "
    "judged"
)
"""The note of a run without gradients: what the report could not judge."""


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _exact(observed: Run, reference: Run) -> tuple[list[Finding], list[str]]:
    """Findings for logits, loss and gradients that cannot be noise; the gradients merely off."""
    findings = [
        Finding(
            "parity",
            "logits",
            f"{dtype_name(reference.logits.dtype)} bit-identical",
            "bit-identical"
            if torch.equal(observed.logits, reference.logits)
            else f"max |diff| {_max_diff(observed.logits, reference.logits):.3g}",
            torch.equal(observed.logits, reference.logits),
        ),
        Finding(
            "parity",
            "loss",
            f"{reference.loss.item():.6g}",
            f"{observed.loss.item():.6g}",
            torch.equal(observed.loss, reference.loss),
        ),
    ]
    off: list[str] = []
    for name, want in reference.grads.items():
        got = observed.grads.get(name)
        if want is None or got is None:
            if (want is None) != (got is None):
                findings.append(
                    Finding(
                        "parity", f"grad {name}", str(want is not None), str(got is not None), False
                    )
                )
            continue
        if got.dtype != want.dtype:
            findings.append(
                Finding(
                    "parity", f"grad {name}", dtype_name(want.dtype), dtype_name(got.dtype), False
                )
            )
        elif not torch.equal(got, want):
            off.append(name)
    return findings, off


def check_parity(
    observed: Run,
    reference: Run,
    control: Callable[[], ControlMeasure],
    on_any_rank: Callable[[bool], bool] = bool,
    *,
    measure_spread: bool = False,
) -> tuple[list[Finding], list[str]]:
    """Compare the two runs; ``control`` is called only if some gradient is not bit-identical
    (or ``measure_spread`` asks for it whatever the gradients).

    ``control`` returns what the control measured (its error per gradient, and the spread of
    its two runs where it ran twice: :class:`~pytest_fp32keep.contract.parity_policy.
    ControlMeasure`); if it raises, the error is reported as a finding, not raised. The control
    runs FSDP2 collectives, so whether to run it is decided by ``on_any_rank(this rank has a
    gradient that is not bit-identical)``, the same answer on every rank
    (:meth:`~pytest_fp32keep.contract.verdicts.Agreement.on_any_rank`): a rank whose gradients
    are all exact still runs the control with its peers, and ignores it.

    Returns:
        the findings and the notes for the report.
    """
    findings, off = _exact(observed, reference)
    if not any(grad is not None for grad in (*reference.grads.values(), *observed.grads.values())):
        return findings, [FORWARD_ONLY]
    anywhere = on_any_rank(bool(off) or measure_spread)
    measured: ControlMeasure | str = ControlMeasure({})
    if anywhere:
        try:
            measured = control()
        except Exception as exc:  # a diagnostic: its failure is reported, not raised
            measured = f"{type(exc).__name__}: {exc}"
    if not off:  # the control, if it ran, was for a peer or for measure_spread: notes only
        findings.append(Finding("parity", "every gradient", "bit-identical", "bit-identical", True))
        return findings, gradient_bounds(measured)[2] if measure_spread else []
    bounds, control_findings, notes = gradient_bounds(measured)
    findings += control_findings
    errors = {
        name: relative_error(observed.grads[name], reference.grads[name])  # type: ignore[arg-type]
        for name in off
    }
    notes.append(
        f"{len(off)} gradient(s) not bit-identical: at most {max(errors.values()):.3g} "
        "(relative to the gradient's scale) from the reference"
    )
    spread = measured.spread if isinstance(measured, ControlMeasure) else None
    for name, error in errors.items():
        bound = bounds.get(name, 0.0)
        widened = (spread or {}).get(name, 0.0) if bound else 0.0
        expected = (
            "bit-identical (control)"
            if not bound
            else f"<= {bound:.3g} relative (control {bound - widened:.3g} + spread {widened:.3g})"
            if widened
            else f"<= {bound:.3g} relative (control)"
        )
        findings.append(
            Finding("parity", f"grad {name}", expected, f"{error:.3g} relative", error <= bound)
        )
    return findings, notes
