"""``docs/families.md``: family x Transformers version x dtype, from ``fp32keep check`` reports.

    python -m pytest_fp32keep.check.families.table --output docs/families.md \\
        --versions 4.56,5.10,latest [--master-versions latest] [--oracle JUNIT.xml ...] \\
        REPORT.json ...

Each REPORT is the ``--report-json`` of one ``fp32keep check --all-families`` run (one
Transformers version; its version is read from the report). A cell is ``pass`` (with how many
tensors are kept), ``refused (reason)`` (``apply_fsdp2`` raised ``KeepLayoutError``: its reason
tags, the refused tensors, and where that refusal is written as expected, or that none is; the
"Refusals" section says why), ``not buildable (reason)``, ``not runnable (reason)`` (the
unsharded reference itself crashed, see :func:`reference_crash`, or the family's forward is random
by design: :data:`.overrides.STOCHASTIC`), or ``FAIL (row)`` (the failing
checks, the error's last line, or how a refusal differs from the written one); ``-`` where that
version has no such family. A version of ``--versions`` without a report is ``not yet run``:
nothing is invented.

A report of ``fp32keep check --master-dtype fp32`` (FP32 master weights; the report's
``master_dtype``) is the other storage convention: it goes to the section "FP32 master weights",
under its label of ``--master-versions``, with its own runs (torch named), totals, table and
refusals, and never into the table of low-precision storage.

Each ``--oracle`` is the JUnit XML of one run of the plan oracle (``tests/test_families.py``
with ``--slow``) under one Transformers version, which the run records as the
test-suite property ``transformers``; the page's "Plan oracle" section says per version how many
family x dtype cases were compared with ``from_pretrained``, how many were equal, which differed,
which could not be compared (the round trip raised), and how many were skipped (not buildable).
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pytest_fp32keep.check.targets import FAMILY_PREFIX

DTYPES = ("bf16", "fp16")
#: How much of a reason a cell keeps.
_CELL_CHARS = 140
KINDS = ("pass", "refused", "not buildable", "not runnable", "FAIL")
#: A report's ``master_dtype`` under ``--master-dtype fp32`` (FP32 master weights); ``None``: the
#: parameters that are not kept stored in the low dtype.
MASTERS = "fp32"


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip().replace("|", "\\|")
    return text if len(text) <= _CELL_CHARS else text[: _CELL_CHARS - 3] + "..."


def case_cell(case: dict[str, Any]) -> str:
    """The cell of one case of a report."""
    outcome = case["outcome"]
    if outcome == "refused":
        tags = sorted(set(re.findall(r"\[([a-z][a-z-]*)\]", str(case.get("message", "")))))
        fqns = list(case.get("refused", []))
        more = f" +{len(fqns) - 2} more" if len(fqns) > 2 else ""
        what = f"{'/'.join(tags) or 'KeepLayoutError'}: {_short(', '.join(fqns[:2]) + more)}"
        if case.get("refusal_mismatch"):
            return f"FAIL (refused, {_short(str(case['refusal_mismatch']))})"
        if not case.get("expect_layout_error"):
            return f"refused ({what}; no refusal written)"
        written = case.get("written", {}).get("written_in") or "the zoo"  # older reports
        return f"refused ({what}; as written in {written})"
    if outcome == "pass" and not case.get("expect_layout_error"):
        kept = len(case.get("kept", []))
        return f"pass ({kept} kept)" if kept else "pass (nothing kept)"
    if outcome == "pass":
        return "FAIL (not refused, though the zoo expects KeepLayoutError)"
    crash = reference_crash(case)
    if crash is not None:
        return f"not runnable (unsharded reference: {_short(crash)})"
    if outcome == "fail":
        failed = sorted({finding["check"] for finding in case.get("failures", [])})
        return f"FAIL ({', '.join(failed) or 'contract'})"
    lines = [line for line in str(case.get("message", "")).strip().splitlines() if line.strip()]
    return f"FAIL ({_short(lines[-1] if lines else 'error')})"


def first_problem(message: str) -> str:
    """The first problem line of a ``KeepLayoutError`` message (the tensor, its reason tag, its
    module and class, what the module owns beside it), without the generic ``Fix:`` advice."""
    line = next(
        (line for line in message.splitlines() if re.match(r"\s+\S+\s+\[[a-z-]+\] ", line)),
        message.strip().splitlines()[0] if message.strip() else "",
    )
    return re.sub(r"\s+", " ", line.split(" Fix:")[0]).strip()


def _refusal_lines(
    by_label: dict[str, dict[str, Any]], labels: Sequence[str], heading: str = "## Refusals"
) -> list[str]:
    """The "Refusals" section: per refused family, where (version, dtype), the first problem
    of the refusal and where its expectation is written, with why (or that none is)."""
    found: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for label in labels:
        for case in by_label.get(label, {}).get("cases", []):
            target = str(case["target"])
            if (
                target.startswith(FAMILY_PREFIX)
                and case["context"] == "autocast"
                and case["outcome"] == "refused"
            ):
                found.setdefault(target.removeprefix(FAMILY_PREFIX), []).append((label, case))
    if not found:
        return []
    lines = [
        "",
        heading,
        "",
        "Each refused family: where (version dtype), the first problem `apply_fsdp2` names (the",
        "tensor, its module and class, the module's own parameters the plan does not keep: FSDP2",
        "puts a module's own parameters in one unit of one dtype), and where the refusal is",
        "written as expected, with why, from the modeling code. Only that refusal passes: another",
        "reason, or other tensors, fail the check.",
        "",
    ]
    for family in sorted(found):
        cases = found[family]
        where = ", ".join(f"{label} {case['dtype']}" for label, case in cases)
        label, case = cases[-1]  # the latest version's words
        lines.append(f"- {family} ({where}): `{first_problem(str(case.get('message', '')))}`")
        written = case.get("written") or {}
        if case.get("refusal_mismatch"):
            lines.append(f"  FAIL at {label} {case['dtype']}: {case['refusal_mismatch']}")
        elif case.get("expect_layout_error") and written:
            lines.append(f"  Written in {written.get('written_in')}: {written.get('why') or '-'}")
        elif case.get("expect_layout_error"):
            lines.append("  Expected by the zoo.")
        else:
            lines.append("  No refusal is written: the check fails.")
    return lines


def reference_crash(case: dict[str, Any]) -> str | None:
    """The exception of the unsharded reference's forward or backward, when that crash is the
    case's only failure; else ``None``.

    The ``reference`` step runs the model cast the keep-aware way (what ``from_pretrained(dtype=D)``
    gives: the plan oracle of ``tests/test_families.py`` checks that per family), unsharded, in the
    case's context, before FSDP2 runs anything: a model that crashes there, or computes a NaN or
    an infinity (``NonFiniteReference``), cannot run at that dtype on that device at all
    (AudioFlamingo3 on CPU: ``mixed dtype (CPU)``). That is not a
    FSDP2 result, so the cell says ``not runnable`` and why, never ``pass``. Any other failing
    check beside it keeps the case a ``FAIL``.
    """
    if case.get("outcome") != "fail":
        return None
    failures = list(case.get("failures", []))
    if not failures or any(
        (finding.get("check"), finding.get("subject")) != ("crashed", "reference")
        for finding in failures
    ):
        return None
    return str(failures[0].get("observed", "error"))


def report_cells(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    """``(family, dtype) -> cell`` of one report (every dtype of an unbuildable family)."""
    cells: dict[tuple[str, str], str] = {}
    for case in report["cases"]:
        target = str(case["target"])
        if target.startswith(FAMILY_PREFIX) and case["context"] == "autocast":
            cells[(target.removeprefix(FAMILY_PREFIX), case["dtype"])] = case_cell(case)
    for target, reason in report.get("unavailable", {}).items():
        if target.startswith(FAMILY_PREFIX):
            for dtype in DTYPES:
                cells[(target.removeprefix(FAMILY_PREFIX), dtype)] = _short(reason)
    return cells


def kind(cell: str) -> str:
    """Which of :data:`KINDS` a cell is."""
    return next((name for name in KINDS if cell.startswith(name)), "FAIL")


def _label(version: str, labels: Sequence[str]) -> str:
    """The ``--versions`` label a full version belongs to (``5.10.4`` -> ``5.10``)."""
    for label in labels:
        if label != "latest" and (version == label or version.startswith(label + ".")):
            return label
    return "latest"


#: The oracle's test function in ``tests/test_families.py``; its cases are what the section counts.
ORACLE_TEST = "test_family_plan_matches_from_pretrained"


class OracleRun(NamedTuple):
    """One plan-oracle run read from its JUnit XML (cases are ``FAMILY-DTYPE`` ids)."""

    transformers: str
    equal: tuple[str, ...]
    differing: tuple[str, ...]
    errors: tuple[str, ...]
    skipped: tuple[str, ...]

    @property
    def compared(self) -> int:
        """Cases where the plan was compared with ``from_pretrained`` (equal or not)."""
        return len(self.equal) + len(self.differing)

    def summary(self) -> str:
        """One line: the counts, and every differing or erroring case by name."""

        def named(cases: tuple[str, ...]) -> str:
            return f" ({', '.join(cases)})" if cases else ""

        return (
            f"transformers {self.transformers}: {self.compared} family x dtype cases compared "
            f"with from_pretrained, {len(self.equal)} equal, {len(self.differing)} "
            f"differing{named(self.differing)}, {len(self.errors)} not compared (an error in "
            f"the round trip){named(self.errors)}, {len(self.skipped)} skipped (not buildable)"
        )


def read_oracle(path: Path) -> OracleRun:
    """The oracle cases of one JUnit XML file (other tests of the file are not counted).

    A case is named by its parametrize id, ``FAMILY-DTYPE``. It differs when it failed on an
    ``AssertionError`` (the oracle's verdict), is an error when it failed on anything else
    (``save_pretrained`` / ``from_pretrained`` raised) or errored in a fixture, differs as well
    when it is an expected failure (``<skipped type="pytest.xfail">``: a difference written in
    ``KNOWN_DIFFERENCES``), is skipped when it has another ``<skipped>``, and is equal otherwise.
    """
    root = ElementTree.parse(path).getroot()
    version = next(
        (
            str(prop.get("value"))
            for prop in root.iter("property")
            if prop.get("name") == "transformers"
        ),
        "?",
    )
    found: dict[str, list[str]] = {"equal": [], "differing": [], "errors": [], "skipped": []}
    for case in root.iter("testcase"):
        if not str(case.get("name", "")).startswith(ORACLE_TEST + "["):
            continue
        name = str(case.get("name"))[len(ORACLE_TEST) + 1 : -1]  # FAMILY-DTYPE
        failure = case.find("failure")
        if failure is not None:
            verdict = str(failure.get("message", "")).startswith("AssertionError")
            found["differing" if verdict else "errors"].append(name)
        elif case.find("error") is not None:
            found["errors"].append(name)
        elif (skipped := case.find("skipped")) is not None:
            # a written difference (strict xfail of tests/test_families.py) still differs
            known = skipped.get("type") == "pytest.xfail"
            found["differing" if known else "skipped"].append(name + " (written)" * known)
        else:
            found["equal"].append(name)
    return OracleRun(version, *(tuple(found[key]) for key in OracleRun._fields[1:]))


def _oracle_lines(oracles: Sequence[OracleRun], labels: Sequence[str]) -> list[str]:
    by_label = {_label(run.transformers, labels): run for run in oracles}
    lines = [
        "",
        "## Plan oracle",
        "",
        "`pytest --slow tests/test_families.py` under the same Transformers:",
        "per family and dtype, `save_pretrained` of the tiny model, then",
        "`from_pretrained(dtype=D)`; the persistent tensors it leaves FP32 must be exactly the",
        "ones `resolve_keep_plan` keeps.",
        "",
    ]
    for label in labels:
        run = by_label.get(label)
        lines.append(f"- {label}: " + (run.summary() if run else "not yet run"))
    return lines


def _by_label(reports: Sequence[dict[str, Any]], labels: Sequence[str]) -> dict[str, Any]:
    """Each report under the label its Transformers version belongs to."""
    return {_label(report["versions"]["transformers"], labels): report for report in reports}


def _run_lines(by_label: dict[str, dict[str, Any]], labels: Sequence[str]) -> list[str]:
    """One line per label: the versions, torch included, the date, commit and wall time."""
    lines = []
    for label in labels:
        found = by_label.get(label)
        if found is None:
            lines.append(f"- {label}: not yet run")
            continue
        report, versions = found, found["versions"]
        lines.append(
            f"- {label}: transformers {versions['transformers']}, torch {versions['torch']}, "
            f"{report.get('date', '?')}, commit {report.get('commit') or '?'}, "
            f"{report.get('seconds', '?')} s"
        )
    return lines


def _grid_lines(
    by_label: dict[str, dict[str, Any]], labels: Sequence[str], heading: str = "##"
) -> list[str]:
    """The totals per label and dtype, then the table of every family of these reports."""
    cells = {label: report_cells(report) for label, report in by_label.items()}
    families = sorted({family for table in cells.values() for family, _ in table})
    columns = [(label, dtype) for label in labels for dtype in DTYPES]
    lines = ["", f"{heading} Totals", "", "| version | dtype | " + " | ".join(KINDS) + " |"]
    lines.append("|---|---|" + "---|" * len(KINDS))
    for label, dtype in columns:
        if label not in cells:
            lines.append(
                f"| {label} | {dtype} | " + " | ".join(["not yet run"] * len(KINDS)) + " |"
            )
            continue
        counts = Counter(kind(cell) for (_, d), cell in cells[label].items() if d == dtype)
        lines.append(f"| {label} | {dtype} | " + " | ".join(str(counts[k]) for k in KINDS) + " |")
    lines += ["", f"{heading} Table", ""]
    lines.append("| family | " + " | ".join(f"{label} {dtype}" for label, dtype in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for family in families:
        row = []
        for label, dtype in columns:
            if label not in cells:
                row.append("not yet run")
            else:
                row.append(cells[label].get((family, dtype), "-"))
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    return lines


def _masters_lines(by_label: dict[str, dict[str, Any]], labels: Sequence[str]) -> list[str]:
    """The "FP32 master weights" section: its runs (torch named), totals, table and refusals."""
    lines = [
        "",
        "## FP32 master weights",
        "",
        "The same families under the other storage convention:",
        "`fp32keep check --all-families --master-dtype fp32 --dtype bf16,fp16 --nproc 2` stores",
        "every trainable parameter in FP32 (`fp32keep.upcast_to_fp32_master`) and lets the",
        "policy's `param_dtype` cast for compute, as accelerate, verl and torchtitan train. On",
        "torch >= 2.15 `apply_fsdp2` keeps the kept parameters FP32 inside the caller's own units",
        "(`MixedPrecisionPolicy(param_dtype_override_fn=...)`), so no refusal is expected there:",
        "a refused cell is a failing case. Each run names its torch.",
        "",
        "### Runs",
        "",
        *_run_lines(by_label, labels),
        *_grid_lines(by_label, labels, heading="###"),
    ]
    return lines + _refusal_lines(by_label, labels, heading="### Refusals")


def render(
    reports: Sequence[dict[str, Any]],
    labels: Sequence[str],
    oracles: Sequence[OracleRun] = (),
    master_labels: Sequence[str] = (),
) -> str:
    """The whole ``docs/families.md`` (the oracle section only when ``oracles`` are given).

    A report of ``--master-dtype fp32`` (its ``master_dtype``) goes to the "FP32 master weights"
    section, under ``master_labels`` (a label without such a report: ``not yet run``), never to
    the table of low-precision storage; that section is there when ``master_labels`` are given.
    """
    storage = [report for report in reports if report.get("master_dtype") != MASTERS]
    masters = [report for report in reports if report.get("master_dtype") == MASTERS]
    if masters and not master_labels:
        raise ValueError(
            f"{len(masters)} report(s) of --master-dtype {MASTERS} given without --master-versions:"
            " name their Transformers labels, e.g. --master-versions latest"
        )
    by_label = _by_label(storage, labels)
    lines = [
        "# Every Transformers family whose model keeps a tensor",
        "",
        "Generated by `python -m pytest_fp32keep.check.families.table` (which `nox -s families`",
        "runs) from",
        "`fp32keep check --all-families --dtype bf16,fp16 --nproc 2 --report-json ...` on each",
        "Transformers version; do not edit by hand. A family is listed when the plan",
        "(`fp32keep.resolve_keep_plan`) of its built model keeps a tensor at fp16 or bf16: its own",
        "code declares a keep list, or its default config holds a declaring model's (MusicGen's",
        "T5 encoder). Each family is its picked class (the whole model first, then the class that",
        "declares; `pytest_fp32keep/check/families/discovery.py`) built from its default config,",
        "shrunk automatically, in 2 ranks on gloo, forward under autocast. `-`: that version has",
        'no such family (or its model keeps nothing there). The tables up to "Refusals" store',
        'the parameters that are not kept in the low dtype; "FP32 master weights" stores them',
        "in FP32.",
        "",
        "## Runs",
        "",
        *_run_lines(by_label, labels),
        *_grid_lines(by_label, labels),
    ]
    lines += _refusal_lines(by_label, labels)
    if master_labels:
        lines += _masters_lines(_by_label(masters, master_labels), master_labels)
    if oracles:
        lines += _oracle_lines(oracles, labels)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Render ``--output`` from the reports given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="*", type=Path, help="fp32keep check --report-json files")
    parser.add_argument("--output", type=Path, required=True, help="the Markdown file to write")
    parser.add_argument(
        "--versions", default="4.56,5.10,latest", help="Transformers labels, the table's columns"
    )
    parser.add_argument(
        "--master-versions",
        default="",
        help="Transformers labels of the --master-dtype fp32 runs; adds the 'FP32 master "
        "weights' section (a label without such a report: not yet run)",
    )
    parser.add_argument(
        "--oracle",
        action="append",
        default=[],
        type=Path,
        help="JUnit XML of a plan-oracle run (repeatable); adds the 'Plan oracle' section",
    )
    args = parser.parse_args(argv)
    labels, master_labels = (
        [label.strip() for label in text.split(",") if label.strip()]
        for text in (args.versions, args.master_versions)
    )
    reports = [json.loads(path.read_text()) for path in args.reports]
    oracles = [read_oracle(path) for path in args.oracle]
    for run in oracles:  # the session log shows the counts, not only the page
        print(f"plan oracle, {run.summary()}")
    try:
        page = render(reports, labels, oracles, master_labels)
    except ValueError as error:  # before the page is touched
        parser.error(str(error))
    args.output.write_text(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
