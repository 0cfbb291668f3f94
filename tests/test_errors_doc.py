"""docs/errors.md cannot drift from the code: its rows are checked against the test sources.

Static and cheap (``ast`` over the cited test files; no subprocess, no rank): every cited node id
exists (parametrize ids included), every row's error type appears in the source of each of its
tests, every row's time bound is the bound its tests assert (``tests/error_bounds.py``), and every
exception class of ``fp32keep.errors`` and every ``KeepLayoutError`` reason tag has a row.

A test's *source* here is its function with its decorators, plus whatever module-level function,
fixture or constant of its own file it names, transitively: helpers and inner-session sources
count, imported helpers do not.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
from pathlib import Path

import pytest

import fp32keep.errors
from tests import error_bounds

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
#: Where the layout's refusals are built: the planner, and the wording of its refusals.
LAYOUT_SOURCES = tuple(sorted((ROOT / "impl" / "fp32keep" / "layout").glob("*.py")))
HEADINGS = ("Library, bad layouts", "Library, bad calls", "Plugin and CLI", "Runner faults")
COLUMNS = ["Row", "Situation", "What the user sees", "Time bound", "Test"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the doc's tables."""

    heading: str
    name: str
    sees: str
    bound: str
    tests: tuple[str, ...]

    @property
    def error_type(self) -> str:
        """The first code span of "What the user sees": the error the user meets."""
        found = re.search(r"`([^`]+)`", self.sees)
        assert found, f"row {self.name}: 'What the user sees' must start with `ErrorType`"
        return found.group(1)

    @property
    def seconds(self) -> float:
        """The number the "Time bound" column starts with."""
        found = re.match(r"(\d+(?:\.\d+)?) s\b", self.bound)
        assert found, f"row {self.name}: the time bound {self.bound!r} is not 'N s ...'"
        return float(found.group(1))


def read_rows(text: str) -> list[Row]:
    """Every table row under a ``##`` heading; each table must have the doc's columns."""
    rows: list[Row] = []
    heading = ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            continue
        if not line.startswith("|") or re.fullmatch(r"[|\-: ]+", line):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if cells[0] == COLUMNS[0]:
            assert cells == COLUMNS, f"table under {heading!r} has columns {cells}"
            continue
        assert len(cells) == len(COLUMNS), f"row {cells[0]!r} has {len(cells)} cells"
        tests = tuple(re.findall(r"`([^`]+::[^`]+)`", cells[4]))
        rows.append(Row(heading, cells[0], cells[2], cells[3], tests))
    return rows


@functools.cache
def doc_rows() -> tuple[Row, ...]:
    return tuple(read_rows(DOC.read_text(encoding="utf-8")))


@functools.cache
def module(path: str) -> tuple[tuple[str, ...], dict[str, ast.stmt]]:
    """A test file's lines and its module-level definitions by name."""
    source = (ROOT / path).read_text(encoding="utf-8")
    definitions: dict[str, ast.stmt] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            definitions[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    definitions[target.id] = node
    return tuple(source.splitlines()), definitions


def split_nodeid(nodeid: str) -> tuple[str, str, str | None]:
    path, _, rest = nodeid.partition("::")
    name, _, param = rest.partition("[")
    return path, name, param[:-1] if param else None


@dataclasses.dataclass(frozen=True)
class Source:
    """A test's source closure: its text and the identifiers it uses."""

    text: str
    names: frozenset[str]


@functools.cache
def source_of(path: str, name: str) -> Source:
    lines, definitions = module(path)
    texts: list[str] = []
    names: set[str] = set()
    todo, seen = [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in definitions:
            continue
        seen.add(current)
        node = definitions[current]
        decorators = getattr(node, "decorator_list", [])
        start = min([node.lineno, *(decorator.lineno for decorator in decorators)])
        texts.append("\n".join(lines[start - 1 : node.end_lineno]))
        for child in ast.walk(node):
            if isinstance(child, ast.Name):
                names.add(child.id)
                todo.append(child.id)
            elif isinstance(child, ast.Attribute):
                names.add(child.attr)
            elif isinstance(child, ast.arg):  # a fixture of the same file
                todo.append(child.arg)
    return Source("\n".join(texts), frozenset(names))


def parametrize_ids(function: ast.FunctionDef) -> set[str] | None:
    """The ids pytest gives ``function``'s cases (empty: not parametrized; None: not static)."""
    calls = [
        decorator
        for decorator in function.decorator_list
        if isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Attribute)
        and decorator.func.attr == "parametrize"
    ]
    if not calls:
        return set()
    if len(calls) > 1:
        return None
    call = calls[0]
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    explicit = keywords.get("ids")
    if isinstance(explicit, ast.List | ast.Tuple):
        ids = [element.value for element in explicit.elts if isinstance(element, ast.Constant)]
        return {str(value) for value in ids} if len(ids) == len(explicit.elts) else None
    values = call.args[1] if len(call.args) > 1 else keywords.get("argvalues")
    if not isinstance(values, ast.List | ast.Tuple):
        return None
    found: set[str] = set()
    for element in values.elts:
        if isinstance(element, ast.Call) and getattr(element.func, "attr", "") == "param":
            given = [k.value for k in element.keywords if k.arg == "id"]
            if not given or not isinstance(given[0], ast.Constant):
                return None
            found.add(str(given[0].value))
        elif isinstance(element, ast.Constant) and isinstance(element.value, str | int):
            found.add(str(element.value))
        else:
            return None
    return found


def cited_tests() -> list[str]:
    return sorted({nodeid for row in doc_rows() for nodeid in row.tests})


def test_the_doc_has_the_four_groups_and_every_row_cites_a_test() -> None:
    rows = doc_rows()
    assert [heading for heading in HEADINGS if any(r.heading == heading for r in rows)] == list(
        HEADINGS
    ), "a group of rows is missing"
    assert {row.heading for row in rows} <= set(HEADINGS), "a row outside the four groups"
    names = [row.name for row in rows]
    assert len(names) == len(set(names)), "row names repeat"
    assert all(row.tests for row in rows), [row.name for row in rows if not row.tests]


@pytest.mark.parametrize("nodeid", cited_tests())
def test_every_cited_test_exists(nodeid: str) -> None:
    path, name, param = split_nodeid(nodeid)
    assert (ROOT / path).is_file(), f"{nodeid}: no file {path}"
    function = module(path)[1].get(name)
    assert isinstance(function, ast.FunctionDef), f"{nodeid}: no test function {name} in {path}"
    assert name.startswith("test_"), f"{nodeid}: pytest would not collect {name}"
    ids = parametrize_ids(function)
    assert ids is not None, f"{nodeid}: give the cases of {name} explicit ids (pytest.param)"
    if param is not None:
        assert param in ids, f"{nodeid}: {name} has no case [{param}]; it has {sorted(ids)}"


@pytest.mark.parametrize("row", doc_rows(), ids=lambda row: row.name)
def test_every_row_error_type_is_checked_by_each_of_its_tests(row: Row) -> None:
    for nodeid in row.tests:
        path, name, _ = split_nodeid(nodeid)
        source = source_of(path, name)
        assert row.error_type in source.text, f"{nodeid} never mentions {row.error_type!r}"


@pytest.mark.parametrize("row", doc_rows(), ids=lambda row: row.name)
def test_every_row_bound_is_the_bound_its_tests_assert(row: Row) -> None:
    known = error_bounds.bounds()
    used: dict[str, float] = {}
    for nodeid in row.tests:
        source = source_of(*split_nodeid(nodeid)[:2])
        used.update({name: known[name] for name in source.names if name in known})
    assert used, f"row {row.name}: none of {row.tests} asserts a bound of tests/error_bounds.py"
    wrong = {name: value for name, value in used.items() if value != row.seconds}
    assert not wrong, f"row {row.name} says {row.seconds:g} s; its tests assert {wrong}"


def test_every_exception_of_fp32keep_errors_has_a_row() -> None:
    exceptions = [
        name
        for name, value in vars(fp32keep.errors).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == fp32keep.errors.__name__
    ]
    assert len(exceptions) >= 3, exceptions  # the check must not pass vacuously
    types = {row.error_type for row in doc_rows()}
    assert sorted(set(exceptions) - types) == []


def layout_reason_tags() -> set[str]:
    """The reason of every ``LayoutProblem(...)`` that a module of ``fp32keep.layout`` builds."""
    tags: set[str] = set()
    trees = [ast.parse(source.read_text(encoding="utf-8")) for source in LAYOUT_SOURCES]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "LayoutProblem"
        ):
            reason = node.args[1] if len(node.args) > 1 else None
            assert isinstance(reason, ast.Constant), "a LayoutProblem reason that is not literal"
            tags.add(str(reason.value))
    return tags


def test_every_layout_reason_tag_has_a_row_whose_tests_trigger_it() -> None:
    tags = layout_reason_tags()
    assert len(tags) >= 5, tags
    for tag in sorted(tags):
        rows = [row for row in doc_rows() if f"`[{tag}]`" in row.sees]
        assert rows, f"no row of docs/errors.md shows `[{tag}]`"
        for row in rows:
            for nodeid in row.tests:
                text = source_of(*split_nodeid(nodeid)[:2]).text
                assert f'"{tag}"' in text, f"{nodeid} (row {row.name}) never names {tag!r}"
