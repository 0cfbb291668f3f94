"""What the contract saw: the findings, the report that holds them, and how both render.

It owns the names of the contract items (:data:`CHECKS`), one observation (:class:`Finding`),
one row per kept tensor (:class:`KeptTensor`), the report (:class:`ContractReport`: its table,
summary and JSON) and the assertion error that carries it (:class:`ContractViolation`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

import torch

from pytest_fp32keep.contract.advice import differing_part, what_to_do
from pytest_fp32keep.contract.probe import dtype_name

CheckName = Literal[
    "stored", "materialized", "boundary", "operators", "parity", "round trip", "crashed"
]
CHECKS: tuple[CheckName, ...] = (
    "stored",
    "materialized",
    "boundary",
    "operators",
    "parity",
    "round trip",
    "crashed",
)

#: The widest a column of :meth:`ContractReport.table` gets; longer cells wrap.
CELL_WIDTH = 70


def _wrap(cell: str, width: int) -> list[str]:
    """``cell`` in lines of at most ``width`` characters, broken after ``"; "`` or a space where
    possible; only the spaces at the breaks are dropped."""
    lines: list[str] = []
    while len(cell) > width:
        cut = max(cell.rfind("; ", 0, width - 1) + 2, cell.rfind(" ", 0, width) + 1)
        if cut <= 1:
            cut = width
        lines.append(cell[:cut].rstrip())
        cell = cell[cut:]
    lines.append(cell)
    return lines


@dataclasses.dataclass(frozen=True)
class Finding:
    """One contract item observed for one tensor or module.

    Attributes:
        check: which contract item.
        subject: the tensor FQN, module FQN (with call and leaf), or output name.
        expected: what the contract requires.
        observed: what happened.
        ok: whether they agree.
    """

    check: CheckName
    subject: str
    expected: str
    observed: str
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """What the contract saw for one kept tensor."""

    fqn: str
    entry: str
    list_kind: str
    stored: str
    materialized: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ContractReport:
    """Everything :func:`assert_fp32_keep_contract` checked, passed or not.

    Attributes:
        model_name: the model's class name.
        dtype: the low-precision dtype.
        context: ``"autocast"`` or ``"direct"``, with forward prefetch on or off.
        kept: one row per kept tensor name.
        findings: every observation, passing ones included.
        notes: context a reader needs (e.g. the control run's gradient error).
    """

    model_name: str
    dtype: torch.dtype
    context: str
    kept: tuple[KeptTensor, ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()

    @property
    def failures(self) -> tuple[Finding, ...]:
        """The findings that break the contract."""
        return tuple(f for f in self.findings if not f.ok)

    @property
    def ok(self) -> bool:
        """True when every finding passed."""
        return not self.failures

    def status(self) -> dict[CheckName, bool]:
        """Per contract item: passed (True) or not (an item with no finding did not fail)."""
        return {check: all(f.ok for f in self.findings if f.check == check) for check in CHECKS}

    def checked(self) -> dict[CheckName, bool | None]:
        """Per contract item: passed, failed, or ``None`` where it has no finding at all (not
        run, because a step it needs crashed; or nothing to observe)."""
        ran = {f.check for f in self.findings}
        return {check: ok if check in ran else None for check, ok in self.status().items()}

    def table(self, *, failures_only: bool = False, highlight: bool = False) -> str:
        """A readable text table of the findings.

        Columns are at most :data:`CELL_WIDTH` characters wide; a longer cell continues on the
        next lines of its row, so nothing a finding says is cut off. With ``highlight`` (the
        violation's message), a long expected/observed pair shows where it differs: the common
        prefix elided with ``"…"``, the first differing element marked ``»like this«``
        (:func:`~pytest_fp32keep.contract.advice.differing_part`).
        """
        rows = [f for f in self.findings if not (failures_only and f.ok)]
        header = ("check", "subject", "expected", "observed", "")
        cells = [header]
        for f in rows:
            expected, observed = (
                differing_part(f.expected, f.observed) if highlight else (f.expected, f.observed)
            )
            cells.append((f.check, f.subject, expected, observed, "ok" if f.ok else "FAIL"))
        widths = [min(max(len(row[i]) for row in cells), CELL_WIDTH) for i in range(len(header))]
        lines: list[str] = []
        for row in cells:
            pieces = [_wrap(cell, width) for cell, width in zip(row, widths, strict=True)]
            for k in range(max(len(p) for p in pieces)):
                line = "  ".join(
                    (p[k] if k < len(p) else "").ljust(width)
                    for p, width in zip(pieces, widths, strict=True)
                )
                lines.append(line.rstrip())
        return "\n".join(lines)

    def summary(self) -> str:
        """One line per contract item, then the kept tensors."""
        lines = [
            f"FP32-keep contract for {self.model_name} at {dtype_name(self.dtype)} ({self.context})"
        ]
        for check, passed in self.checked().items():
            count = sum(1 for f in self.findings if f.check == check)
            shown = {True: "pass", False: "FAIL", None: "-"}[passed]
            lines.append(f"  {check:<12} {shown} ({count} observations)")
        for row in self.kept:
            lines.append(
                f"  kept {row.fqn} [{row.list_kind} {row.entry!r}] stored {row.stored}, "
                f"all-gathered {row.materialized}"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "model": self.model_name,
            "dtype": dtype_name(self.dtype),
            "context": self.context,
            "ok": self.ok,
            "status": self.status(),
            "kept": [row.to_dict() for row in self.kept],
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(), indent=2)


class ContractViolation(AssertionError):
    """The FP32-keep contract does not hold; ``report`` holds every finding.

    The message: the headline ``FP32-keep contract broken for MODEL at DTYPE (CONTEXT): KINDS``,
    one table of the failing findings (check, subject, expected, observed; long pairs show
    where they differ), then ``what to do:`` with one line per failing kind (cause and fix).
    """

    def __init__(self, report: ContractReport) -> None:
        self.report = report
        failed = sorted(
            {f.check for f in report.failures},
            key=lambda kind: (CHECKS.index(kind) if kind in CHECKS else len(CHECKS), kind),
        )
        lines = [
            f"FP32-keep contract broken for {report.model_name} at {dtype_name(report.dtype)} "
            f"({report.context}): {', '.join(failed)}",
            report.table(failures_only=True, highlight=True),
            *what_to_do(failed),
        ]
        super().__init__("\n".join(lines))
