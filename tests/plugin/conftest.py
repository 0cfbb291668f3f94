"""Fixtures for the plugin's own tests: inner projects driven through real pytest sessions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.plugin._inner import InnerProject, new_tag, tagged_project


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[InnerProject]:
    """An inner project (pytester) whose pytest, torchrun and ranks carry a unique tag."""
    with tagged_project(pytester, monkeypatch) as project:
        yield project


@pytest.fixture(scope="module")
def module_inner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InnerProject]:
    """An inner project shared by the checks of one module (one expensive session)."""
    project = InnerProject(tmp_path_factory.mktemp("inner"), new_tag())
    yield project
    project.kill_leftovers()
