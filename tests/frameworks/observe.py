"""What one framework case showed: the contract rows that failed, or the exception it died with.

A row is a contract check (``stored``, ``materialized``, ...) and what the failing subject is: a
kept tensor or a module that owns one (``materialized (kept)``), any other tensor or module
(``stored (not kept)``), the model's outputs (``parity (output)``: logits or loss), or the
contract's own control run, the same units sharded correctly (``parity (control)``: the
contract could not measure the gradient noise, which is not the framework's doing). A step of
the framework that raised is the contract's own ``crashed`` row, shown with the step:
``crashed (shard)``. A case that still raises anything but ``ContractViolation`` (a refusal) is
``crash: TypeName``, with the message and the innermost frame kept for the table.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

from pytest_fp32keep import ContractReport, ContractViolation
from pytest_fp32keep.contract.report import Finding
from tests.frameworks.harness import Setup

RESULTS_ENV = "FP32KEEP_FRAMEWORKS_RESULTS"
"""Folder for one JSON record per case; unset: nothing is written."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The failing rows of one case (empty: the contract held), or the crash."""

    rows: frozenset[str]
    crash: str | None = None
    kept: int = 0
    examples: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


OUTPUTS = frozenset({"logits", "loss"})


def _kind(subject: str, kept: set[str]) -> str:
    """``kept``, ``not kept``, ``output`` or ``control``: what a finding's subject is."""
    if subject in OUTPUTS:
        return "output"
    if subject.startswith("control"):
        return "control"
    modules = {name.rpartition(".")[0] for name in kept}
    for token in subject.replace("(", " ").replace(")", " ").replace(",", " ").split():
        name = token.split("[")[0].split(":")[0]
        if name in kept or name in modules:
            return "kept"
    return "not kept"


def _row(finding: Finding, kept: set[str]) -> str:
    if finding.check == "crashed":  # the subject is the step that raised: "crashed (forward)"
        return f"crashed ({finding.subject})"
    return f"{finding.check} ({_kind(finding.subject, kept)})"


def rows_of(report: ContractReport) -> frozenset[str]:
    """The row of every failing finding of ``report``."""
    kept = {row.fqn for row in report.kept}
    return frozenset(_row(f, kept) for f in report.failures)


def _crash(exc: BaseException) -> str:
    """``Type: first line of the message (at function, file:line)``, the innermost frame."""
    first = (str(exc).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].name}, {Path(frames[-1].filename).name}:{frames[-1].lineno})"
    return f"{type(exc).__name__}: {first}{where if frames else ''}"


def examples_of(report: ContractReport) -> tuple[str, ...]:
    """The first failing finding of each row, as one line: what a reader of the table checks."""
    kept = {row.fqn for row in report.kept}
    first: dict[str, str] = {}
    for f in report.failures:
        row = _row(f, kept)
        first.setdefault(row, f"{row}: {f.subject}: expected {f.expected}, observed {f.observed}")
    return tuple(first[row] for row in sorted(first))


def observe(run: Callable[[], ContractReport]) -> Outcome:
    """Run one case and classify what happened."""
    try:
        report = run()
    except ContractViolation as violation:
        report = violation.report
        return Outcome(
            rows_of(report),
            kept=len(report.kept),
            examples=examples_of(report),
            notes=tuple(report.notes),
        )
    except Exception as exc:  # a framework's crash is a finding, never a skip
        return Outcome(frozenset({f"crash: {type(exc).__name__}"}), _crash(exc))
    return Outcome(frozenset(), kept=len(report.kept), notes=tuple(report.notes))


def record(setup: Setup, model: str, dtype: str, outcome: Outcome) -> None:
    """Write the case's JSON record into ``$FP32KEEP_FRAMEWORKS_RESULTS`` (when set)."""
    folder = os.environ.get(RESULTS_ENV)
    if not folder:
        return
    dists = (setup.dist, "transformers", "torch")
    versions = {name: importlib.metadata.version(name) for name in dists}
    cause = setup.causes.get(model)
    data = {
        "setup": setup.name,
        "framework": setup.dist,
        "description": setup.description,
        "versions": versions,
        "model": model,
        "dtype": dtype,
        "rows": sorted(outcome.rows),
        "crash": outcome.crash,
        "kept": outcome.kept,
        "examples": list(outcome.examples),
        "notes": list(outcome.notes),
        "why": cause.why if cause and outcome.rows else "",
        "where": cause.where if cause and outcome.rows else "",
        "reproducer": setup.reproducer(model),
    }
    slug = setup.name.replace(",", "").replace(" ", "-")
    for char in "'()+>=":
        slug = slug.replace(char, "")
    path = Path(folder) / f"{slug}--{model}--{dtype}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
