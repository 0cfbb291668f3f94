"""docs/transformers-keep-semantics.md and the resolver say the same thing.

The page's two *checked* tables are parsed here: each cell of the rules table is compared with
what :func:`fp32keep.plan.compat.semantics_for` holds for releases of that column's group, and each
row of the edge-case table is resolved on a toy model under each group. A wrong cell in a crafted
copy of the page fails the same comparison (the negative controls at the end).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fp32keep import KeepDeclarationError, resolve_keep_plan
from fp32keep.plan.compat import KeepSemantics, semantics_for
from tests.core.toys import model_with_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers-keep-semantics.md"

#: The releases each column of the rules table stands for (both ends of every group).
RULE_COLUMNS = (("4.56.2", "4.57.6"), ("5.0.0", "5.0.0rc1"), ("5.1.0", "5.10.4", "5.25.0"))
#: The release each "kept by" column of the edge-case table is resolved under.
EDGE_COLUMNS = (("4.56.2",), ("5.0.0", "5.10.4"))

DTYPE_WORDS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _dtypes(cell: str) -> frozenset[torch.dtype]:
    return frozenset(DTYPE_WORDS[word.strip()] for word in cell.split(","))


def _yes_no(cell: str) -> bool:
    assert cell in ("yes", "no"), f"expected yes or no, got {cell!r}"
    return cell == "yes"


def _bare_string(semantics: KeepSemantics) -> str:
    try:
        return "ignored" if semantics.declared("wo") is None else "kept as entries"
    except KeepDeclarationError:
        return "refused"


def _code(cell: str) -> str:
    match = re.fullmatch(r"`(.*)`", cell)
    assert match, f"expected one `code` span, got {cell!r}"
    return match.group(1)


#: Each row label of the rules table -> (what the page says, what the code says) for a release.
RULE_ROWS: dict[str, Callable[[str, KeepSemantics], tuple[object, object]]] = {
    "the regular list applies at": lambda c, s: (_dtypes(c), s.regular_dtypes),
    "the strict list applies at": lambda c, s: (_dtypes(c), s.strict_dtypes),
    "the pattern built from the entry `a*b`": lambda c, s: (_code(c), s.entry_pattern("a*b")),
    "tuple and set declarations count": lambda c, s: (_yes_no(c), not s.lists_only),
    "a bare string declared instead of a list": lambda c, s: (c, _bare_string(s)),
    "entries are checked when the model is built": lambda c, s: (
        _yes_no(c),
        s.validates_entries,
    ),
    "loading follows `model.dtype_plan`": lambda c, s: (_yes_no(c), s.reads_dtype_plan),
    "tensors the model code builds in FP32 stay FP32": lambda c, s: (
        _yes_no(c),
        s.keeps_constructed_fp32,
    ),
}


def table_after(text: str, heading: str, marker: str) -> list[list[str]]:
    """The rows (cells, `\\|` unescaped) of the first table after ``marker`` under ``heading``."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = section.split(marker, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
        rows.append([cell.strip().replace("\\|", "|") for cell in cells])
    return rows


def rule_disagreements(text: str) -> list[str]:
    """Every cell of the rules table that differs from ``semantics_for``."""
    rows = table_after(text, "Three behaviour groups", "*Checked*")
    assert {row[0] for row in rows} == set(RULE_ROWS), "the rules table's rows changed"
    wrong = []
    for label, *cells in rows:
        for cell, versions in zip(cells, RULE_COLUMNS, strict=True):
            for version in versions:
                said, done = RULE_ROWS[label](cell, semantics_for(version))
                if said != done:
                    wrong.append(f"{label!r} under {version}: page {said!r}, code {done!r}")
    return wrong


def _names(cell: str) -> list[str]:
    return [_code(part.strip()) for part in cell.split(",")]


def _kept(entry: str, names: list[str], version: str) -> set[str] | str:
    model = model_with_names(names, regular=[entry])
    try:
        plan = resolve_keep_plan(model, torch.float16, transformers_version=version)
    except KeepDeclarationError:
        return "refused"
    return set(plan.param_names)


def edge_disagreements(text: str) -> list[str]:
    """Every edge-case row whose kept names differ from what the resolver keeps."""
    rows = table_after(text, "Edge cases", "*Checked*")
    assert rows, "the edge-case table is empty"
    wrong = []
    for entry_cell, names_cell, *kept_cells in rows:
        entry = _code(entry_cell)
        entry = "" if entry == '""' else entry
        for cell, versions in zip(kept_cells, EDGE_COLUMNS, strict=True):
            said = "refused" if cell == "refused" else set(_names(cell))
            for version in versions:
                done = _kept(entry, _names(names_cell), version)
                if said != done:
                    wrong.append(f"{entry!r} under {version}: page {said!r}, resolver {done!r}")
    return wrong


def test_rules_table_agrees_with_compat() -> None:
    assert rule_disagreements(DOC.read_text()) == []


def test_edge_cases_agree_with_the_resolver() -> None:
    assert edge_disagreements(DOC.read_text()) == []


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        # group C's regular gate said to include bf16 (5.0.0's rule)
        ("| the regular list applies at | fp16 | fp16, bf16 | fp16 |",
         "| the regular list applies at | fp16 | fp16, bf16 | fp16, bf16 |"),
        # 5.0.0 said to count tuples and sets
        ("| tuple and set declarations count | yes | no | yes |",
         "| tuple and set declarations count | yes | yes | yes |"),
    ],
)  # fmt: skip
def test_a_wrong_rule_cell_is_caught(good: str, bad: str) -> None:
    text = DOC.read_text()
    assert good in text
    assert rule_disagreements(text.replace(good, bad))


def test_a_wrong_edge_case_is_caught() -> None:
    text = DOC.read_text()
    good = "| `norm.weight` | `norm.weight`, `input_layernorm.weight`, `q_norm.weight` |"
    assert good in text
    # 4.x said to match substrings, as 5.x does
    bad = good.replace("| `norm.weight` |", "| `norm.weight`, `q_norm.weight` |", 1)
    assert edge_disagreements(text.replace(good, bad))
    refused = "| `wo(` | `a.wo.weight` | refused | refused |"
    assert refused in text
    # 5.x said to keep what an invalid pattern names
    kept = "| `wo(` | `a.wo.weight` | refused | `a.wo.weight` |"
    assert edge_disagreements(text.replace(refused, kept))
