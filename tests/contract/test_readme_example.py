"""The README's downstream example, executed verbatim in an inner pytest session."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    pattern = r"```python\n(# test_my_model_fp32keep\.py\n.*?)```"
    blocks = re.findall(pattern, README.read_text(), re.S)
    assert len(blocks) == 1, "README must hold exactly one '# test_my_model_fp32keep.py' example"
    return blocks[0]


def test_readme_downstream_example_runs_and_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_my_model_fp32keep=readme_example())
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=900)
    result.assert_outcomes(passed=4)
