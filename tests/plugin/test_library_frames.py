"""fp32keep's own errors read as messages, not as the library's source (issue 36, item 5).

A test that calls fp32keep and gets one of its deliberate errors (an ``Fp32KeepError``: a
refused layout, a plan for another dtype) used to print every fp32keep frame under
``--tb=long``: ``apply_fsdp2``'s and ``plan_layout``'s docstrings and source, hundreds of lines,
and the refusal's problem lines up to 275 columns. Every fp32keep module sets
``__tracebackhide__ = fp32keep.errors.hidden_in_tracebacks``: pytest hides those frames for the
library's own errors only, so a bug inside the library still shows where it is. The runner wraps
a rank's long ``E`` lines to 100 columns (``runner/tracebacks.py``'s ``wrap_error_lines``).

The inner sessions here start no rank (plain tests); the multi-rank refusal is read in
``tests/plugin/test_failure_messages.py``.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
from _pytest._code.code import ExceptionChainRepr, ReprEntry

import fp32keep
from fp32keep.errors import hidden_in_tracebacks
from pytest_fp32keep.runner.tracebacks import ERROR_WIDTH, wrap_error_lines
from tests.inner_outcomes import run_inner_session
from tests.plugin._inner import failure_section

INNER = """
import pytest
import torch
from torch import nn

import fp32keep


class Toy(nn.Module):
    _keep_in_fp32_modules_strict = ["norm"]

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Broken(Toy):
    def named_parameters(self, *args, **kwargs):
        raise RuntimeError("a model whose parameters cannot be listed")


def test_a_plan_for_another_dtype():
    model = Toy()
    plan = fp32keep.resolve_keep_plan(model, torch.float16)
    fp32keep.keep_aware_cast(model, torch.bfloat16, plan=plan)


def test_a_bug_below_the_library():
    fp32keep.keep_aware_cast(Broken(), torch.bfloat16)
"""


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> str:
    project = tmp_path_factory.mktemp("frames")
    session = run_inner_session(project, {"test_frames.py": INNER}, "--tb=long", timeout=300)
    assert session.returncode == 1, session.output[-4000:]
    return session.output


def test_an_error_of_fp32keep_shows_the_callers_line_and_the_message(output: str) -> None:
    text = failure_section(output, "test_a_plan_for_another_dtype")
    assert "fp32keep.keep_aware_cast(model, torch.bfloat16, plan=plan)" in text  # the user's line
    assert "KeepPlanError: keep_aware_cast(dtype=torch.bfloat16) was given a keep plan" in text
    assert "fp32keep/cast.py" not in text and "fp32keep/plan/use.py" not in text, text
    assert "def keep_aware_cast(" not in text and "def check_plan_for_cast(" not in text, text


def test_a_bug_inside_the_library_still_shows_its_frames(output: str) -> None:
    # negative control: not an Fp32KeepError, so fp32keep's frames stay where the bug is
    text = failure_section(output, "test_a_bug_below_the_library")
    assert "RuntimeError: a model whose parameters cannot be listed" in text
    assert "fp32keep/cast.py" in text or "fp32keep/plan" in text, text


def test_every_fp32keep_module_hides_its_frames_for_its_own_errors() -> None:
    folder = Path(fp32keep.__file__).parent
    modules = list(pkgutil.walk_packages([str(folder)], prefix="fp32keep."))
    assert any(module.name == "fp32keep.layout.planning" for module in modules)  # subpackages read
    for module in modules:
        imported = importlib.import_module(module.name)
        if module.ispkg:  # a subpackage's __init__ only says what it holds: no frame of its own
            source = Path(imported.__file__ or "").read_text(encoding="utf-8")
            assert not any(
                isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Import | ast.ImportFrom)
                for node in ast.parse(source).body
            ), f"{module.name}/__init__.py holds code: give it __tracebackhide__"
            continue
        # the exceptions themselves, and the reprs their messages use (imported by errors, so it
        # cannot import the hook back): no frame of theirs raises through them
        if module.name in {"fp32keep.errors", "fp32keep.reprs"}:
            continue
        assert getattr(imported, "__tracebackhide__", None) is hidden_in_tracebacks, module.name
    # what the hook decides: fp32keep's errors hidden, anything else shown
    try:
        raise fp32keep.KeepPlanError("refused")
    except fp32keep.KeepPlanError:
        assert hidden_in_tracebacks(pytest.ExceptionInfo.from_current())
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        assert not hidden_in_tracebacks(pytest.ExceptionInfo.from_current())
    assert not hidden_in_tracebacks(None)  # pytest may ask without an exception


def _failure_repr(message: str) -> ExceptionChainRepr:
    try:
        raise ValueError(message)
    except ValueError:
        made = pytest.ExceptionInfo.from_current().getrepr(style="long")
    assert isinstance(made, ExceptionChainRepr)
    return made


def _error_lines(longrepr: ExceptionChainRepr) -> list[str]:
    entry = longrepr.chain[-1][0].reprentries[-1]
    assert isinstance(entry, ReprEntry)
    return [line for line in entry.lines if line.startswith("E")]


def test_long_error_lines_of_a_rank_are_wrapped_to_100_columns() -> None:
    problem = "  query_tokens  [root-owned] " + " ".join(["is kept but no unit owns it"] * 12)
    made = _failure_repr("FSDP2 cannot keep the FP32 contract of Toy\n" + problem)
    before = _error_lines(made)
    assert max(len(line) for line in before) > ERROR_WIDTH  # pytest leaves it long
    after = _error_lines(wrap_error_lines(made))
    assert max(len(line) for line in after) <= ERROR_WIDTH, after
    assert len(after) > len(before)

    # nothing lost: the same words in the same order, the aligned listing kept on its first line
    def words(lines: list[str]) -> list[str]:
        return " ".join(line.removeprefix("E") for line in lines).split()

    assert words(after) == words(before)
    assert any("  query_tokens  [root-owned] is kept" in line for line in after), after
    assert _error_lines(made) == before  # the input is left as it is
    # negative control: a message that fits is left exactly as pytest wrote it
    short = _failure_repr("FSDP2 cannot keep the FP32 contract of Toy")
    assert str(wrap_error_lines(short)) == str(short)
