"""What the contract saw: the findings, the report that holds them, and how both render.

It owns the names of the contract items (:data:`CHECKS`), one observation (:class:`Finding`),
one row per kept tensor (:class:`KeptTensor`), the report (:class:`ContractReport`: its table,
summary and JSON) and the assertion error that carries it (:class:`ContractViolation`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any, Literal, get_args

import torch

from pytest_fp32keep.contract.advice import (
    MESSAGE_WIDTH,
    OPERATOR_CAUSES,
    PARITY_CAUSES,
    differing_part,
    explains_operators,
    follow_from,
    follow_from_operators,
    operator_module,
    what_to_do,
)
from pytest_fp32keep.contract.probe import dtype_name

CheckName = Literal[
    "stored",
    "materialized",
    "boundary",
    "operators",
    "parity",
    "round trip",
    "kept count",
    "crashed",
]
#: The checks in the order a report lists them (``CheckName``'s own); ``kept count`` has a row only
#: under ``expect_kept`` (:mod:`.kept`).
CHECKS: tuple[CheckName, ...] = get_args(CheckName)

#: The widest a column of :meth:`ContractReport.table` gets; longer cells wrap.
CELL_WIDTH = 70
#: Fitting a table into a width narrows its widest columns, down to this (a check's name fits).
MIN_CELL_WIDTH = 12
_GAP = "  "


def _wrap(cell: str, width: int) -> list[str]:
    """``cell`` in lines of at most ``width`` characters, broken after ``"; "`` or a space where
    possible, else after a ``.``, ``,``, ``(`` or ``/`` inside a long name; only the spaces at
    the breaks are dropped."""
    lines: list[str] = []
    while len(cell) > width:
        # A break keeps the line within width once the spaces at it are dropped.
        cut = max(cell.rfind("; ", 0, width) + 2, cell.rfind(" ", 0, width + 1) + 1)
        if cut <= 1:
            cut = max(cell.rfind(mark, 0, width) + 1 for mark in ".,(/")
        if cut <= 1:
            cut = width
        lines.append(cell[:cut].rstrip())
        cell = cell[cut:]
    lines.append(cell)
    return lines


@functools.lru_cache(maxsize=4096)
def _line_count(cell: str, width: int) -> int:
    return len(_wrap(cell, width))


def _column_widths(cells: Sequence[tuple[str, ...]], width: int | None) -> list[int]:
    """Each column's width: its longest cell, at most CELL_WIDTH. With ``width``, and rows
    wider than it, the columns share ``width`` (none below MIN_CELL_WIDTH) the way that wraps
    the fewest rows, then the fewest lines (ties: the earlier columns wider): a short row
    stays on one line when a long one has to wrap anyway."""
    columns = len(cells[0])
    natural = [min(max(len(row[i]) for row in cells), CELL_WIDTH) for i in range(columns)]
    room = None if width is None else width - len(_GAP) * (columns - 1)
    if room is None or sum(natural) <= room:
        return natural
    flexible = [i for i in range(columns) if natural[i] > MIN_CELL_WIDTH]
    fixed = sum(natural[i] for i in range(columns) if i not in flexible)

    rows = collections.Counter(cells)

    def cost(widths: list[int]) -> tuple[int, int]:
        heights = [
            (count, max(_line_count(cell, w) for cell, w in zip(row, widths, strict=True)))
            for row, count in rows.items()
        ]
        wrapped = sum(count for count, height in heights if height > 1)
        return wrapped, sum(count * height for count, height in heights)

    best: tuple[tuple[int, int], list[int]] | None = None
    for shares in _shares([natural[i] for i in flexible], room - fixed):
        widths = list(natural)
        for i, share in zip(flexible, shares, strict=True):
            widths[i] = share
        score = cost(widths)
        if best is None or score < best[0]:
            best = (score, widths)
    return best[1] if best is not None else natural


def _shares(caps: list[int], room: int) -> Iterator[list[int]]:
    """Every way to give each column MIN_CELL_WIDTH..cap that fills ``room`` (the last column
    takes what is left), the earlier columns' widest first; all at the minimum if none fits."""
    if len(caps) == 1:
        yield [max(MIN_CELL_WIDTH, min(caps[0], room))]
        return
    rest_min = MIN_CELL_WIDTH * (len(caps) - 1)
    top = min(caps[0], room - rest_min)
    if top < MIN_CELL_WIDTH:
        yield [MIN_CELL_WIDTH] * len(caps)
        return
    for first in range(top, MIN_CELL_WIDTH - 1, -1):
        for rest in _shares(caps[1:], room - first):
            yield [first, *rest]


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

    def table(
        self,
        *,
        failures_only: bool = False,
        highlight: bool = False,
        findings: Sequence[Finding] | None = None,
        width: int | None = None,
    ) -> str:
        """A readable text table of the findings (``findings``: these rows instead).

        Columns are at most :data:`CELL_WIDTH` characters wide, and with ``width`` the widest
        ones narrow until a line fits in it; a longer cell continues on the next lines of its
        row, so nothing a finding says is cut off. With ``highlight`` (the violation's
        message), a long expected/observed pair shows where it differs: the common prefix
        elided with ``"…"``, the first differing element marked ``»like this«``
        (:func:`~pytest_fp32keep.contract.advice.differing_part`).
        """
        chosen = self.findings if findings is None else findings
        rows = [f for f in chosen if not (failures_only and f.ok)]
        header = ("check", "subject", "expected", "observed", "")
        cells = [header]
        for f in rows:
            expected, observed = (
                differing_part(f.expected, f.observed) if highlight else (f.expected, f.observed)
            )
            cells.append((f.check, f.subject, expected, observed, "ok" if f.ok else "FAIL"))
        widths = _column_widths(cells, width)
        lines: list[str] = []
        for row in cells:
            pieces = [_wrap(cell, width) for cell, width in zip(row, widths, strict=True)]
            for k in range(max(len(p) for p in pieces)):
                line = _GAP.join(
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


def _order(kind: str) -> int:
    """A check's place in the contract's order (:data:`CHECKS`); anything else after it."""
    return CHECKS.index(kind) if kind in CHECKS else len(CHECKS)


def _explained_operators(failures: Sequence[Finding]) -> list[Finding]:
    """The failing ``operators`` rows that a failing ``stored``, ``materialized`` or
    ``boundary`` row of the same kept module explains
    (:func:`~pytest_fp32keep.contract.advice.explains_operators`)."""
    causes = [f for f in failures if f.check in OPERATOR_CAUSES]
    return [
        f
        for f in failures
        if f.check == "operators"
        and any(explains_operators(c.check, c.subject, operator_module(f.subject)) for c in causes)
    ]


class ContractViolation(AssertionError):
    """The FP32-keep contract does not hold; ``report`` holds every finding.

    The message, laid out to fit 100 columns as pytest prints it: the headline
    ``FP32-keep contract broken for MODEL at DTYPE (CONTEXT): KINDS`` (every failing kind, in
    the order of :data:`CHECKS`; wrapped, continuation lines indented); one table of the
    failing findings in that order, so that the cause leads (check, subject, expected,
    observed; long pairs show where they differ; long cells wrap); the ``operators`` rows a
    ``stored``, ``materialized`` or ``boundary`` failure of the same kept module explains, and
    the parity rows an earlier failure explains, each folded into one line
    (:func:`~pytest_fp32keep.contract.advice.follow_from_operators`,
    :func:`~pytest_fp32keep.contract.advice.follow_from`; every row stays in
    ``report.failures``); then ``what to do:`` with one line per failing kind (a ``crashed``
    line per distinct cause: :func:`~pytest_fp32keep.contract.advice.crash_advice`).
    """

    def __init__(self, report: ContractReport) -> None:
        self.report = report
        failures = sorted(report.failures, key=lambda f: _order(f.check))  # stable: cause first
        failed = sorted({f.check for f in failures}, key=lambda kind: (_order(kind), kind))
        causes = [kind for kind in failed if kind in PARITY_CAUSES]
        explained = _explained_operators(failures)
        shown = [
            f
            for f in failures
            if not (causes and f.check == "parity") and not any(f is g for g in explained)
        ]
        folded = [f.subject for f in failures if causes and f.check == "parity"]
        operator_cause = next((kind for kind in failed if kind in OPERATOR_CAUSES), "")
        operators = [f.subject for f in explained]
        crashes = [(f.subject, f.observed) for f in failures if f.check == "crashed"]
        # pytest prints the first line after "pytest_fp32keep.ContractViolation: ".
        before = " " * len(f"{type(self).__module__}.{type(self).__qualname__}: ")
        headline = textwrap.wrap(
            f"FP32-keep contract broken for {report.model_name} at {dtype_name(report.dtype)} "
            f"({report.context}): {', '.join(failed)}",
            MESSAGE_WIDTH,
            initial_indent=before,
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
        lines = [
            headline[0].removeprefix(before),
            *headline[1:],
            report.table(highlight=True, findings=shown, width=MESSAGE_WIDTH),
            *(follow_from_operators(operator_cause, operators) if operators else []),
            *(follow_from(causes[0], folded) if folded else []),
            *what_to_do(failed, crashes=crashes),
        ]
        super().__init__("\n".join(lines))


# Raised to users as the public name (``pytest_fp32keep.ContractViolation``, which is also how
# pytest prints it: shorter than this module's path, and it leaves the headline room).
ContractViolation.__module__ = "pytest_fp32keep"
