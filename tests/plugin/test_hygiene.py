"""What a user's settings and a test's leftovers do to marked tests: warnings as errors, warnings
in the summary, torch's global defaults restored between tests, huge output, a kept fixture's
raising teardown.

One inner session (``session``) runs every plain case, each in its own file; the warnings-as-errors
variants need sessions of their own and are in the slow tier (the default tier runs ``-W error``
on the installed wheel, ``tests/test_packaging.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.error_bounds import RANK_FAULT_BOUND_S, note_elapsed
from tests.plugin._inner import (
    PASSING_MARKED_TEST,
    WALL_CLOCK_CONFTEST,
    InnerProject,
    failure_section,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "ini"),
    [
        pytest.param(("-W", "error"), "", id="W-error"),
        pytest.param((), "[pytest]\nfilterwarnings =\n    error\n", id="filterwarnings-error"),
    ],
)
def test_warnings_as_errors_let_marked_tests_run(
    inner: InnerProject, args: tuple[str, ...], ini: str
) -> None:
    if ini:
        (inner.path / "pytest.ini").write_text(ini)
    inner.write(test_strict=PASSING_MARKED_TEST)
    result = inner.run("-rA", *args)
    result.assert_outcomes(passed=1)
    assert "could not start" not in result.stdout.str()


#: One file per case; the session runs them in this (alphabetical) order in one group of ranks.
INNER_FILES = {
    "test_a": """
        import pytest

        pytestmark = pytest.mark.fsdp2

        @pytest.fixture(scope="module")
        def resource():
            yield "resource"
            raise RuntimeError("cleanup of the kept resource failed")

        def test_uses_it(resource):
            assert resource == "resource"

        @pytest.mark.skip(reason="decided in the parent: the ranks never see this test")
        def test_skipped_in_the_parent(resource):
            pass
        """,
    "test_b": """
        import pytest

        @pytest.mark.fsdp2
        def test_next():
            pass
        """,
    "test_defaults": """
        import pytest
        import torch

        pytestmark = pytest.mark.fsdp2

        def test_changes_defaults():
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(False)

        def test_sees_the_usual_defaults():
            assert torch.get_default_dtype() == torch.float32
            assert torch.is_grad_enabled()
        """,
    "test_leak": """
        import pytest
        import torch

        @pytest.mark.fsdp2
        def test_leak_within_one_test():
            torch.set_default_dtype(torch.float64)
            try:
                assert torch.get_default_dtype() == torch.float32
            finally:
                torch.set_default_dtype(torch.float32)
        """,
    "test_loud": """
        import sys
        import pytest

        @pytest.mark.fsdp2
        def test_loud(fsdp2_rank):
            line = "x" * 99 + "\\n"
            sys.stdout.write(line * 300_000)  # 30 MB per rank
            assert fsdp2_rank == 0, "the real failure, after all that output"
        """,
    "test_warns": """
        import warnings
        import pytest

        VIEW = (
            "FSDP2-wrapped module (Block) returned a view tensor. An in-place op on this view "
            "(e.g., `x += y`) will silently drop the pre-backward hook and skip the all-gather, "
            "which can cause backward to fail or produce wrong gradients. Use out-of-place ops "
            "(`out = out + y`, not `out += y`) or `.clone()` the output before any in-place op."
        )

        @pytest.mark.fsdp2
        def test_warns(fsdp2_rank):
            warnings.warn("careful with this model", UserWarning)
            if fsdp2_rank == 1:
                warnings.warn("only rank 1 saw this", DeprecationWarning)
            for unit in range(2):  # as torch warns about views: once per unit, at one place
                warnings.warn(VIEW, UserWarning)
        """,
}


@pytest.fixture(scope="module")
def session(module_inner: InnerProject) -> tuple[InnerProject, pytest.RunResult]:
    """The inner session of every plain case, run once for the checks of this module."""
    module_inner.write(conftest=WALL_CLOCK_CONFTEST, **INNER_FILES)
    return module_inner, module_inner.run("-rA")


def test_every_case_has_its_outcome(session: tuple[InnerProject, pytest.RunResult]) -> None:
    _, result = session
    # test_a+b: 2 passed, 1 skipped, 1 error; defaults: 2 passed (1 warning); leak: 1 failed;
    # loud: 1 failed; warns: 1 passed (3 warnings: identical ones from both ranks are one)
    result.assert_outcomes(passed=5, failed=2, skipped=1, errors=1, warnings=4)


def test_warnings_in_ranks_reach_the_summary_once(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    project, result = session
    text = result.stdout.str()
    assert "RankWarning: [ranks 0,1] UserWarning: careful with this model" in text
    assert "RankWarning: [rank 1] DeprecationWarning: only rank 1 saw this" in text
    # one warning, however many ranks raised it (its source line shows under it once, too)
    assert text.count("UserWarning: careful with this model") == 1
    assert text.count('warnings.warn("careful with this model", UserWarning)') == 1
    result.stdout.fnmatch_lines(["*test_warns.py::test_warns*"])  # the summary names the test
    # ... and where each was raised in the rank: the test file's line, not the runner's
    source = (project.path / "test_warns.py").read_text().splitlines()
    careful = next(n for n, line in enumerate(source, 1) if "careful with this" in line)
    only = next(n for n, line in enumerate(source, 1) if "only rank 1 saw" in line)
    result.stdout.fnmatch_lines(
        [
            f"*test_warns.py:{careful}: RankWarning: [[]ranks 0,1[]] UserWarning: careful*",
            f"*test_warns.py:{only}: RankWarning: [[]rank 1[]] DeprecationWarning: only*",
        ]
    )
    assert "runner/controller.py" not in text


def test_a_warning_raised_twice_per_rank_names_each_rank_once_within_100_columns(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    """Issue 36: torch's view-tensor warning, raised once per unit, read ``[ranks 0,0,1,1]``
    and took about 500 columns."""
    _, result = session
    text = result.stdout.str()
    summary = text[text.index("warnings summary") :]
    (block,) = [b for b in summary.split("\n\n") if "returned a view tensor" in b]
    block = block[block.index("RankWarning: [ranks 0,1]\n") :]
    assert "[ranks 0,0,1,1]" not in text and "[ranks 0,1,0,1]" not in text
    assert "FSDP2-wrapped module (Block) returned a view tensor" in block, block
    # every line of its text within a terminal's 100 columns; nothing of the text lost
    text_lines = block.splitlines()[1:]
    assert len(text_lines) >= 4 and max(len(line) for line in text_lines) <= 100, block
    assert "`.clone()` the output before any in-place op." in " ".join(block.split())
    # negative control: the short warning stays on its one line, as the rank wrote it
    assert "RankWarning: [ranks 0,1] UserWarning: careful with this model\n" in text


def test_changed_torch_defaults_are_restored_and_named(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    _, result = session
    result.stdout.fnmatch_lines_random(["PASSED test_defaults.py::test_sees_the_usual_defaults"])
    # a long warning starts on the line after its ranks, wrapped to 100 columns (issue 36)
    assert (
        "RankWarning: [ranks 0,1] test_defaults.py::test_changes_defaults changed the default "
        "dtype to torch.float64, grad mode to disabled and did not restore it"
    ) in " ".join(result.stdout.str().split())


def test_negative_control_defaults_leak_without_the_restore(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    """The restore check above can fail: in one test body, the leak is visible."""
    _, result = session
    result.stdout.fnmatch_lines_random(["FAILED test_leak.py::test_leak_within_one_test*"])


def test_huge_output_is_spilled_to_a_file_and_the_failure_still_reported(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    project, result = session
    text = result.stdout.str()
    result.stdout.fnmatch_lines_random(["FAILED test_loud.py::test_loud*"])
    assert "AssertionError: the real failure, after all that output" in text
    assert "internal error" not in text
    spilled = re.findall(r"characters cut here; the whole text is in (\S+)\]", text)
    assert spilled, text[-3000:]
    whole = Path(spilled[0]).read_text()
    assert len(whole) >= 30_000_000 and whole.count("x" * 99) == 300_000
    assert len(text) < 5_000_000  # the terminal got the head and the tail, not 60 MB
    # from its start to its report: no grace ran out while the ranks printed
    wall = project.wall_times()["test_loud.py::test_loud"]
    assert wall < RANK_FAULT_BOUND_S, wall
    note_elapsed(wall)


def test_teardown_error_of_a_fixture_kept_from_an_earlier_test_is_an_error(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    """The ranks keep module fixtures for the test they expect next; when the parent skips that
    test, they tear the fixture down before the next one, and a raising teardown is an error."""
    _, result = session
    text = failure_section(result.stdout.str(), "test_next")
    assert "tearing down fixtures kept from an earlier test raised before this test" in text
    assert "RuntimeError: cleanup of the kept resource failed" in text
    result.stdout.fnmatch_lines_random(
        ["PASSED test_a.py::test_uses_it", "ERROR test_b.py::test_next*"]
    )
