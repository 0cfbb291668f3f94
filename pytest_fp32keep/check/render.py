"""The results of ``fp32keep check`` as terminal text and as Markdown (reports).

Pure functions over the JSON-ready result that :mod:`pytest_fp32keep.check.cli` assembles from
what :mod:`pytest_fp32keep.check.ranks` writes (``cases``, ``device``, ``backend``,
``view_warnings``) plus what the command knows (``nproc``, ``versions``, ``commit``,
``threads``, ``seconds``, ``date``, ``unavailable``): no I/O. The terminal text fits the width
it is given (:mod:`.layout`); Markdown is not wrapped.
"""

from __future__ import annotations

from typing import Any

from pytest_fp32keep.check.layout import (
    Column,
    column_widths,
    fit_lines,
    render_table,
    table_width,
    wrap_text,
)
from pytest_fp32keep.check.rank_verdicts import disagreement, ranks_label

CHECK_COLUMNS = ("stored", "materialized", "boundary", "operators", "parity", "round trip")
#: The terminal's headers for the checks (the full names do not fit 80 columns; the legend
#: names them).
SHORT_CHECK_HEADERS = ("stored", "gather", "bound", "ops", "parity", "trip")
HEADER = ["model", "dtype", "context", "result", *CHECK_COLUMNS, "kept tensors"]
#: Paragraphs (header, legend, notes) are wrapped at most this wide, however wide the terminal.
PROSE_WIDTH = 100
#: The kept-tensors column stays in the table only when it gets this many columns (or all it
#: needs); otherwise each row's kept tensors go on a line of their own under the row.
_KEPT_MIN_WIDTH = 40


def _mark(value: bool | None) -> str:
    return "-" if value is None else ("pass" if value else "FAIL")


def kept_summary(case: dict[str, Any]) -> str:
    """The kept-tensors cell: how many, stored and all-gathered dtypes, or what was refused."""
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
    """The result cell of one case; ``FAIL (rank 1)`` when only some ranks failed it."""
    if case["outcome"] == "refused":
        result = "pass (refused)" if case["ok"] else "FAIL (refused)"
    elif case["expect_layout_error"]:
        result = "FAIL (not refused)"
    elif case["outcome"] == "pass" and not case.get("kept"):
        result = "pass (nothing kept)"  # every row held vacuously: no tensor was kept in FP32
    else:
        result = {"pass": "pass", "fail": "FAIL", "error": "ERROR"}[case["outcome"]]
    if not case.get("ranks_agree", True) and case.get("failed_ranks"):
        result += f" ({ranks_label(case['failed_ranks'])})"
    return result


def case_title(case: dict[str, Any]) -> str:
    """``t5 fp16 autocast``: which case."""
    return f"{case['target']} {case['dtype']} {case['context']}"


def progress_line(index: int, total: int, case: dict[str, Any], width: int) -> str:
    """``[3/18] t5 fp16 autocast ... pass``, its title shortened to fit ``width``."""
    prefix, suffix = f"[{index}/{total}] ", f" ... {case_result(case)}"
    title = case_title(case)
    room = max(8, width - len(prefix) - len(suffix))
    if len(title) > room:
        title = title[: room - 3] + "..."
    return prefix + title + suffix


def _rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for case in cases:
        status = case.get("status") or {}
        rows.append(
            [case["target"], case["dtype"], case["context"], case_result(case)]
            + [_mark(status.get(check)) for check in CHECK_COLUMNS]
            + [kept_summary(case)]
        )
    return rows


def render_table_text(cases: list[dict[str, Any]], width: int) -> list[str]:
    """The model x dtype x check table in at most ``width`` columns.

    The checks get short headers and one space between them; the model and context columns
    wrap when they must. The kept tensors are a column when it fits, else a line under each row
    that keeps (or refuses) anything.
    """
    rows = _rows(cases)
    cells = list(zip(*rows, strict=True)) if rows else [()] * len(HEADER)
    main: list[Column] = []
    for gap in (2, 1):  # one space between all columns before wrapping any
        main = [
            Column("model", cells[0], min_width=12),
            Column("dtype", cells[1], gap=gap),
            Column("context", cells[2], gap=gap, min_width=8),
            Column("result", cells[3], gap=gap, min_width=9),  # "pass" over "(refused)"
        ] + [
            Column(header, cells[4 + i], gap=gap if i == 0 else 1)
            for i, header in enumerate(SHORT_CHECK_HEADERS)
        ]
        if table_width(main, [column.natural_width for column in main]) <= width:
            break
    kept = [str(cell) for cell in cells[-1]]
    kept_column = Column("kept tensors", kept, min_width=_KEPT_MIN_WIDTH)
    room = width - table_width(main, column_widths(main, width)) - kept_column.gap
    if room >= min(kept_column.natural_width, _KEPT_MIN_WIDTH):
        return render_table([*main, kept_column], width)
    below = [
        []
        if text == "none"
        else wrap_text(
            text if text.startswith("refused") else f"kept {text}",
            width,
            first="    ",
            rest="      ",
        )
        for text in kept
    ]
    return render_table(main, width, below=below)


def header_line(result: dict[str, Any]) -> str:
    """What ran where: ranks, backend, threads, versions, commit, cases and time."""
    versions = result.get("versions", {})
    parts = [
        f"{result['nproc']} rank{'s' if result['nproc'] != 1 else ''} on "
        f"{result.get('backend', '?')} ({result.get('device', '?')})"
    ]
    if result.get("threads"):
        parts.append(str(result["threads"]))
    parts += [
        f"torch {versions.get('torch', '?')}",
        f"transformers {versions.get('transformers', '?')}",
        f"pytest-fp32keep {versions.get('pytest-fp32keep', '?')}",
    ]
    if result.get("commit"):
        parts.append(f"commit {result['commit']}")
    cases = len(result["cases"])
    timing = f" in {result['seconds']} s" if "seconds" in result else ""
    parts.append(f"{cases} case{'s' if cases != 1 else ''}{timing}")
    return ", ".join(parts)


#: Who runs each step no ``--cast``/``--shard``/``--load``/``--policy`` replaces.
OWN_STEPS = {
    "cast": "fp32keep's own",
    "shard": "fp32keep's own (apply_fsdp2)",
    "load": "fp32keep's own",
    "policy": "the default",
}


def implementation_steps(result: dict[str, Any]) -> list[str]:
    """``["cast: fp32keep's own", "shard: my.module:shard", ...]``: what ran each step, where
    the command plugged anything in (empty where fp32keep's own steps all ran)."""
    plugins = result.get("plugins") or {}
    if not any(plugins.values()):
        return []
    steps = []
    for step, own in OWN_STEPS.items():
        value = plugins.get(step)
        if value == "none" and step == "load":
            value = "none (round trip not judged)"
        elif step == "load" and plugins.get("load_on_every_rank"):
            value = f"{value} (the full state dict on every rank)"
        steps.append(f"{step}: {value or own}")
    if plugins.get("gradient_divide_factor") is not None:
        factor = plugins["gradient_divide_factor"]
        steps.append(f"gradients: divided by {factor:g}, not the world size (judged at that scale)")
    return steps


def _load_judged(result: dict[str, Any]) -> bool:
    return (result.get("plugins") or {}).get("load") != "none"


#: What each check column means, for the legend.
_MEANING = (
    "dtype at rest",
    "dtype when all-gathered",
    "activation dtypes at kept modules",
    "operators inside kept modules",
    "logits and loss bit-identical to an unsharded reference, each gradient too or within what "
    "the same units sharded correctly give (docs/contract.md)",
    "full-state-dict round trip",
)


def legend_text(
    cases: list[dict[str, Any]], *, short_headers: bool, plugins: dict[str, Any] | None = None
) -> str:
    """What the cells mean; the parts about refusals and never-gathered tensors only when such
    cells are shown. ``plugins`` (the result's): who shards and loads, where the user's own
    functions replaced fp32keep's."""
    plugins = plugins or {}
    names = SHORT_CHECK_HEADERS if short_headers else CHECK_COLUMNS
    parts = [
        f"{name} = {what}" + (f" ({full})" if full not in (name, "operators", "round trip") else "")
        for name, full, what in zip(names, CHECK_COLUMNS, _MEANING, strict=True)
    ]
    text = "; ".join(parts)
    text += "; - = nothing to observe (nothing kept), or not run (a step it needs crashed"
    text += "; the round trip with --load none). " if plugins.get("load") == "none" else "). "
    text += "kept N = tensors kept in FP32: stored / all-gathered dtype"
    if any(row.get("materialized") == "-" for case in cases for row in case.get("kept", [])):
        text += " (- = never all-gathered, e.g. a buffer)"
    text += "."
    if any(case_result(case).startswith("pass (nothing kept)") for case in cases):
        text += (
            " pass (nothing kept) = the contract held with no tensor kept in FP32 at this dtype,"
            " so it checked nothing kept (a note says why; --expect-kept N fails such a case)."
        )
    if any(case["outcome"] == "refused" for case in cases):
        who = f"--shard {plugins['shard']}" if plugins.get("shard") else "apply_fsdp2"
        text += (
            f" pass (refused) = {who} refused a layout FSDP2 cannot keep"
            " (KeepLayoutError), as expected for this model."
        )
    return text


def notes(result: dict[str, Any]) -> list[str]:
    """Summarised known noise from the ranks, and the zoo entries not checked."""
    found = []
    warned = result.get("view_warnings") or {}
    if warned.get("count"):
        modules = list(warned.get("modules", []))
        more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
        shown = ", ".join(modules[:4]) + more
        found.append(
            f"torch warned {warned['count']} times in the ranks: FSDP2-wrapped module returned "
            f"a view tensor ({shown}) - harmless unless your code modifies such outputs in "
            "place, which skips an all-gather (backward would then fail or the gradients "
            "differ, and this check would report it)."
        )
    found += nothing_kept_notes(result["cases"])
    if not _load_judged(result):
        found.append(
            "round trip not judged: --load none loaded no state dict, so every case computed "
            "with the weights it was built with"
        )
    for name, reason in result.get("unavailable", {}).items():
        found.append(f"not checked: {name}: {reason}")
    return found


def nothing_kept_notes(cases: list[dict[str, Any]]) -> list[str]:
    """The contract's note for each case that kept nothing, once per target, dtype and note
    (``t5 bf16: nothing is kept in FP32 at bfloat16: ...``; every context shares it)."""
    # Here, not at the top: the contract imports torch, which the command's usage errors and
    # --list must not wait for.
    from pytest_fp32keep.contract.kept import NOTHING_KEPT

    grouped: dict[tuple[str, str, str], None] = {}
    for case in cases:
        for note in case.get("notes", []):
            if note.startswith(NOTHING_KEPT):
                grouped[(case["target"], case["dtype"], note)] = None
    return [f"{target} {dtype}: {note}" for target, dtype, note in grouped]


def _finding_lines(case: dict[str, Any]) -> list[str]:
    """Where the ranks disagree, a line saying how each rank ended, and each finding its ranks."""
    split = disagreement(case)
    lines = [f"- ranks disagree: {split}"] if split else []
    for finding in case.get("failures", [])[:20]:
        where = f" [{ranks_label(finding['ranks'])}]" if split and finding.get("ranks") else ""
        lines.append(
            f"- `{finding['check']}` {finding['subject']}{where}: expected "
            f"{finding['expected']}, observed {finding['observed']}"
        )
    return lines


def _message(case: dict[str, Any]) -> str:
    if case["outcome"] in ("error", "refused") and not case["ok"] and case["message"]:
        return str(case["message"]).strip()[-3000:]
    return ""


def case_details(case: dict[str, Any]) -> list[str]:
    """Markdown lines: the failing findings (at most 20), then the error message if any."""
    lines = _finding_lines(case)
    message = _message(case)
    if message:
        lines.append("```\n" + message + "\n```")
    return lines


def render_text(result: dict[str, Any], width: int) -> str:
    """The whole terminal report in at most ``width`` columns (where a word allows it): header,
    table, legend, notes and the details of every case that failed."""
    cases = result["cases"]
    prose = min(width, PROSE_WIDTH)
    lines = wrap_text(header_line(result), prose, first="fp32keep check: ", rest="  ")
    for index, step in enumerate(implementation_steps(result)):  # a line each: one to copy
        first = "under test: " if index == 0 else " " * len("under test: ")
        lines += wrap_text(step, prose, first=first, rest=first + "  ")
    lines += ["", *render_table_text(cases, width), ""]
    legend = legend_text(cases, short_headers=True, plugins=result.get("plugins"))
    lines += wrap_text(legend, prose, first="legend: ", rest="  ")
    for note in notes(result):
        lines += wrap_text(note, prose, first="note: ", rest="  ")
    for case in cases:
        if case["ok"]:
            continue
        lines += ["", *wrap_text(f"{case_title(case)}: {case_result(case)}", width)]
        for finding in _finding_lines(case):
            lines += wrap_text(finding, width, rest="    ")
        message = _message(case)
        if message:
            lines += fit_lines("\n".join("    " + line for line in message.splitlines()), width)
    return "\n".join(lines)


def render_markdown(result: dict[str, Any]) -> str:
    """The report as Markdown, ready for ``$GITHUB_STEP_SUMMARY``."""
    cases = result["cases"]
    passed = sum(1 for case in cases if case["ok"])
    lines = [
        "## FP32-keep contract",
        "",
        f"{passed} of {len(cases)} cases pass — {header_line(result)}, {result['date']}.",
        "",
    ]
    steps = implementation_steps(result)
    if steps:
        lines += [f"Under test: {'; '.join(f'`{step}`' for step in steps)}.", ""]
    lines += [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(cases)]
    lines += ["", legend_text(cases, short_headers=False, plugins=result.get("plugins"))]
    lines += [f"\n*Note:* {note}" for note in notes(result)]
    for case in (case for case in cases if not case["ok"]):
        title = f"{case['target']} {case['dtype']} ({case['context']})"
        lines += ["", f"### {title}: {case_result(case)}", ""]
        lines += case_details(case)
    return "\n".join(lines) + "\n"
