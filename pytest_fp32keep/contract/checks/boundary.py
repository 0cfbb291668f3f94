"""The ``boundary`` and ``operators`` items: activation dtypes at, and operators inside, modules."""

from __future__ import annotations

import difflib

from torch import nn

from fp32keep import KeepPlan
from pytest_fp32keep.contract.probe import DtypeProbe, OpDtypes, diff_boundaries, dtype_name
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


def _signature(op: OpDtypes) -> str:
    """``aten.add.Tensor(float32, bfloat16) -> float32``: an operator and its dtypes."""
    inputs = ", ".join(dtype_name(d) for d in op.inputs)
    outputs = ", ".join(dtype_name(d) for d in op.outputs) or "-"
    return f"{op.op}({inputs}) -> {outputs}"


def _dtypes(op: OpDtypes) -> str:
    """``inputs (float32, bfloat16) -> float32``: an operator's dtypes, without its name."""
    inputs = ", ".join(dtype_name(d) for d in op.inputs)
    outputs = ", ".join(dtype_name(d) for d in op.outputs) or "-"
    return f"inputs ({inputs}) -> {outputs}"


def diff_operators(fqn: str, call: int, want: list[OpDtypes], got: list[OpDtypes]) -> list[Finding]:
    """The failing findings of two differing operator sequences of one call.

    The sequences are aligned on the operators' names (:class:`difflib.SequenceMatcher`). An
    aligned operator whose input or output dtypes differ is one finding (subject: the module, the
    call, the operator's position in the reference's sequence and its name; expected and
    observed: its input and output dtypes). Operators run on one side only, or in place of
    others, are one finding per stretch, each side's operators listed in full with their dtypes.
    """
    findings: list[Finding] = []
    where = f"{fqn or '<root>'} call {call}"
    matcher = difflib.SequenceMatcher(a=[o.op for o in want], b=[o.op for o in got], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            findings.extend(
                Finding("operators", f"{where} op #{i} {w.op}", _dtypes(w), _dtypes(g), False)
                for i, w, g in zip(range(i1, i2), want[i1:i2], got[j1:j2], strict=True)
                if w != g
            )
            continue
        if i2 > i1:
            span = f"op #{i1}" if i2 - i1 == 1 else f"ops #{i1}-#{i2 - 1}"
        else:
            span = f"before op #{i1}" if i1 < len(want) else "after the last op"
        findings.append(
            Finding(
                "operators",
                f"{where} {span}",
                "; ".join(_signature(o) for o in want[i1:i2]) or "absent",
                "; ".join(_signature(o) for o in got[j1:j2]) or "absent",
                False,
            )
        )
    return findings


def check_operators(
    reference: DtypeProbe, observed: DtypeProbe, modules: list[str]
) -> list[Finding]:
    """The operators run in each call of ``modules``, with their input and output dtypes, equal
    the reference's; a difference is reported where it is (:func:`diff_operators`)."""
    findings: list[Finding] = []
    for fqn in modules:
        for call in range(min(reference.calls(fqn), observed.calls(fqn))):
            want = reference.op_dtypes(fqn, call)
            got = observed.op_dtypes(fqn, call)
            if want == got:
                shown = f"{len(want)} operators" if want else "-"
                findings.append(Finding("operators", f"{fqn} call {call}", shown, shown, True))
            else:
                findings.extend(diff_operators(fqn, call, want, got))
    return findings
