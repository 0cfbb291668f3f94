"""The results of ``fp32keep check`` as a text table (the terminal) and as Markdown (reports).

Pure functions over the JSON-ready case dictionaries that :mod:`pytest_fp32keep.check.ranks`
writes: no I/O.
"""

from __future__ import annotations

from typing import Any

CHECK_COLUMNS = ("stored", "materialized", "boundary", "operators", "parity", "round trip")


def _mark(value: bool | None) -> str:
    return "-" if value is None else ("pass" if value else "FAIL")


def _kept_summary(case: dict[str, Any]) -> str:
    if case["outcome"] == "refused":
        refused = case.get("refused", [])
        more = f" (+{len(refused) - 2} more)" if len(refused) > 2 else ""
        return f"refused: {', '.join(refused[:2])}{more}"
    kept = case["kept"]
    if not kept:
        return "none"
    stored = sorted({row["stored"] for row in kept})
    gathered = sorted({row["materialized"] for row in kept})
    return f"{len(kept)}: stored {'/'.join(stored)}, all-gathered {'/'.join(gathered)}"


def case_result(case: dict[str, Any]) -> str:
    if case["outcome"] == "refused":
        return "pass (refused)" if case["ok"] else "FAIL (refused)"
    if case["expect_layout_error"]:
        return "FAIL (not refused)"
    return {"pass": "pass", "fail": "FAIL", "error": "ERROR"}[case["outcome"]]


def _rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for case in cases:
        status = case.get("status") or {}
        rows.append(
            [case["target"], case["dtype"], case["context"], case_result(case)]
            + [_mark(status.get(check)) for check in CHECK_COLUMNS]
            + [_kept_summary(case)]
        )
    return rows


HEADER = ["model", "dtype", "context", "result", *CHECK_COLUMNS, "kept tensors"]


def render_text(cases: list[dict[str, Any]]) -> str:
    """The result table as aligned text."""
    rows = [HEADER, *_rows(cases)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def case_details(case: dict[str, Any]) -> list[str]:
    lines = []
    for finding in case.get("failures", [])[:20]:
        lines.append(
            f"- `{finding['check']}` {finding['subject']}: expected {finding['expected']}, "
            f"observed {finding['observed']}"
        )
    if case["outcome"] in ("error", "refused") and not case["ok"] and case["message"]:
        lines.append("```\n" + case["message"].strip()[-3000:] + "\n```")
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    """The report as Markdown, ready for ``$GITHUB_STEP_SUMMARY``."""
    cases = result["cases"]
    passed = sum(1 for case in cases if case["ok"])
    lines = [
        "## FP32-keep contract",
        "",
        f"{passed} of {len(cases)} cases pass — {result['nproc']} ranks on {result['device']}, "
        f"torch {result['versions']['torch']}, transformers {result['versions']['transformers']}, "
        f"{result['date']}.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(cases)]
    for name, reason in result.get("unavailable", {}).items():
        lines.append(f"\n*{name}* not checked: {reason}")
    failing = [case for case in cases if not case["ok"]]
    for case in failing:
        lines += [
            "",
            f"### {case['target']} {case['dtype']} ({case['context']}): {case_result(case)}",
            "",
        ]
        lines += case_details(case)
    return "\n".join(lines) + "\n"
