"""The README's downstream example (``# test_my_model_fp32keep.py``), executed verbatim.

The default tier runs the example's tests as tests of this module: the README block is compiled
under the README's own path and line numbers (a failure points at the README line) and its test
functions become this module's, so they run in the suite's warm ranks like any marked test. The
slow tier also runs it as a user does, in a project of its own (an inner pytest session).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> tuple[str, int]:
    """The example's source and the README line it starts on."""
    text = README.read_text()
    pattern = r"```python\n(# test_my_model_fp32keep\.py\n.*?)```"
    blocks = list(re.finditer(pattern, text, re.S))
    assert len(blocks) == 1, "README must hold exactly one '# test_my_model_fp32keep.py' example"
    return blocks[0].group(1), text.count("\n", 0, blocks[0].start(1)) + 1


def _readme_tests() -> dict[str, object]:
    source, first_line = readme_example()
    namespace: dict[str, object] = {"__name__": __name__}
    exec(compile("\n" * (first_line - 1) + source, str(README), "exec"), namespace)
    return {name: value for name, value in namespace.items() if name.startswith("test_")}


README_TESTS = _readme_tests()
globals().update(README_TESTS)  # collected here, and in the ranks, which import this module too


def test_the_readme_example_defines_marked_tests() -> None:
    """Negative control of the import above: the example's tests are here, and marked."""
    assert README_TESTS, "the README example defines no test function"
    for name, function in README_TESTS.items():
        marks = [mark.name for mark in getattr(function, "pytestmark", [])]
        assert "fsdp2" in marks, f"README's {name} is not marked @pytest.mark.fsdp2: {marks}"


@pytest.mark.slow
def test_readme_downstream_example_runs_and_passes(pytester: pytest.Pytester) -> None:
    source, _ = readme_example()
    pytester.makepyfile(test_my_model_fp32keep=source)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=900)
    result.assert_outcomes(passed=4)
