"""The ``parity`` item: logits, loss and every gradient against the unsharded reference's.

Logits and loss must be bit-identical. Gradients must be too, unless plain FSDP2 itself is not
on the same model: then each may be as far off as the gradient noise policy
(:mod:`pytest_fp32keep.contract.parity_policy`) allows, given the control run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pytest_fp32keep.contract.parity_policy import gradient_bound, relative_error
from pytest_fp32keep.contract.probe import dtype_name
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.steps import Run


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
    dtype: torch.dtype,
    control: Callable[[], Sequence[float]],
) -> tuple[list[Finding], list[str]]:
    """Compare the two runs; ``control`` is called only if some gradient is not bit-identical.

    ``control`` measures plain FSDP2's relative gradient errors (see
    :func:`~pytest_fp32keep.contract.parity_policy.control_error`); if it raises, the error is
    reported as a finding, not raised.

    Returns:
        the findings and the notes for the report.
    """
    findings, off = _exact(observed, reference)
    if not off:
        findings.append(Finding("parity", "every gradient", "bit-identical", "bit-identical", True))
        return findings, []
    keep_error = max(relative_error(observed.grads[n], reference.grads[n]) for n in off)  # type: ignore[arg-type]
    measured: Sequence[float] | str
    try:
        measured = control()
    except Exception as exc:  # a diagnostic: its failure is reported, not raised
        measured = f"{type(exc).__name__}: {exc}"
    bound, control_findings, notes = gradient_bound(measured, dtype)
    findings += control_findings
    notes.append(
        f"{len(off)} gradient(s) not bit-identical: at most {keep_error:.3g} (relative to the "
        f"gradient's scale) from the reference; bound {bound:.3g}"
    )
    for name in off:
        error = relative_error(observed.grads[name], reference.grads[name])  # type: ignore[arg-type]
        findings.append(
            Finding(
                "parity",
                f"grad {name}",
                f"<= {bound:.3g} relative",
                f"{error:.3g} relative",
                error <= bound,
            )
        )
    return findings, notes
