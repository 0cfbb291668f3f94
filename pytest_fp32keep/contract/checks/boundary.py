"""The ``boundary`` and ``operators`` items: activation dtypes at, and operators inside, modules."""

from __future__ import annotations

from torch import nn

from fp32keep import KeepPlan
from pytest_fp32keep.contract.probe import DtypeProbe, diff_boundaries, dtype_name
from pytest_fp32keep.contract.report import Finding


def kept_modules(model: nn.Module, plan: KeepPlan) -> list[str]:
    """Modules whose own floating parameters or buffers are all kept, and their descendants."""
    kept: list[str] = []
    for fqn, module in model.named_modules():
        own = [
            f"{fqn}.{name}" if fqn else name
            for name, tensor in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]
            if tensor.is_floating_point()
        ]
        inside = any(fqn.startswith(k + ".") for k in kept if k)
        if inside or (own and all(name in plan for name in own)):
            kept.append(fqn)
    return kept


def check_boundary(
    reference: DtypeProbe, observed: DtypeProbe, modules: list[str] | None
) -> list[Finding]:
    """The input/output dtypes of ``modules`` (``None``: every module) equal the reference's."""
    findings = [
        Finding(
            "boundary",
            f"{m.fqn or '<root>'} call {m.call} {m.direction} {m.path}",
            dtype_name(m.expected) if m.expected is not None else "absent",
            dtype_name(m.observed) if m.observed is not None else "absent",
            False,
        )
        for m in diff_boundaries(reference, observed, modules=modules)
    ]
    compared = modules if modules is not None else list(reference.modules)
    for fqn in compared:
        if not findings and reference.calls(fqn):
            inputs = reference.boundary_dtypes(fqn).inputs
            shown = ", ".join(f"{p}={dtype_name(d)}" for p, d in inputs.items()) or "-"
            findings.append(Finding("boundary", fqn or "<root>", shown, shown, True))
    return findings


def check_operators(
    reference: DtypeProbe, observed: DtypeProbe, modules: list[str]
) -> list[Finding]:
    """The operators run in each call of ``modules``, with their dtypes, equal the reference's."""
    findings: list[Finding] = []
    for fqn in modules:
        for call in range(min(reference.calls(fqn), observed.calls(fqn))):
            want = reference.op_dtypes(fqn, call)
            got = observed.op_dtypes(fqn, call)
            text_want = "; ".join(
                f"{o.op}->{','.join(dtype_name(d) for d in o.outputs)}" for o in want
            )
            text_got = "; ".join(
                f"{o.op}->{','.join(dtype_name(d) for d in o.outputs)}" for o in got
            )
            findings.append(
                Finding(
                    "operators",
                    f"{fqn} call {call}",
                    text_want or "-",
                    text_got or "-",
                    want == got,
                )
            )
    return findings
