"""The controller is imported only by sessions that collect a marked test (start-up cost)."""

from __future__ import annotations

import json

import pytest

CONFTEST = """
import json, sys
from pathlib import Path

def pytest_unconfigure(config):
    ours = sorted(m for m in sys.modules if m.startswith("pytest_fp32keep."))
    (Path(__file__).parent / "modules.json").write_text(json.dumps(ours))
"""


def imported_modules(pytester: pytest.Pytester, test_source: str) -> list[str]:
    """Our modules a fresh pytest process imported while collecting ``test_source``."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_source)
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "fp32keep")
    result.assert_outcomes()
    names: list[str] = json.loads((pytester.path / "modules.json").read_text())
    return names


def test_a_session_without_marked_tests_never_imports_the_controller(
    pytester: pytest.Pytester,
) -> None:
    modules = imported_modules(pytester, "def test_plain():\n    pass\n")
    assert "pytest_fp32keep.plugin" in modules  # the plugin itself did load
    assert not {"pytest_fp32keep.runner.controller", "pytest_fp32keep.runner.launcher"} & set(
        modules
    )


def test_a_marked_test_brings_the_controller_in(pytester: pytest.Pytester) -> None:
    source = "import pytest\n\n@pytest.mark.fsdp2\ndef test_marked():\n    pass\n"
    modules = imported_modules(pytester, source)
    assert {"pytest_fp32keep.runner.controller", "pytest_fp32keep.runner.launcher"} <= set(modules)
