"""Marked and unmarked tests interleaved across packages: the pytest process's own setup stack
stays in step, so package and module fixtures of unmarked tests are finalised when the run
leaves them, exactly as without the plugin."""

from __future__ import annotations

import pytest


def test_unmarked_after_marked_in_another_package(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        **{
            "a/__init__.py": "",
            "a/conftest.py": """
import pytest

@pytest.fixture(scope="package")
def package_resource(tmp_path_factory):
    yield "a"
    (tmp_path_factory.getbasetemp() / "a-finalised").write_text("1")
""",
            "a/test_a.py": """
import pytest

def test_unmarked(package_resource):
    assert package_resource == "a"

@pytest.mark.fsdp2
def test_marked(fsdp2_world_size):
    assert fsdp2_world_size == 2
""",
            "b/__init__.py": "",
            "b/test_b.py": """
def test_unmarked_in_b(tmp_path_factory):
    assert (tmp_path_factory.getbasetemp() / "a-finalised").exists()
""",
        }
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(passed=3)
