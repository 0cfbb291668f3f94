"""Framework adapters (examples/frameworks/) under the contract: slow tier, pinned versions.

These tests run the contract on several zoo models in two ranks per framework, and each asserts
the exact failing rows of the framework versions pinned in ``ci/matrix.toml``'s
``[frameworks.pins]`` (torch among them): breadth, and meaningful only with those versions. So
they are collected only with ``--slow`` (the suite's one switch, tests/conftest.py) in an
environment that has exactly those versions, which ``nox -s frameworks`` installs. ``pytest
--slow`` elsewhere does not collect them and says so at the end of the run, naming what is
installed: never a skip, never a pass. Collected, a missing framework fails the import.

``FP32KEEP_FRAMEWORKS_RESULTS`` names a folder for one JSON record per case (rank 0 writes it),
from which ``python -m ci.frameworks_report`` renders ``docs/frameworks.md``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from ci.matrix import read_toml
from tests.conftest import slow_tier_selected

FRAMEWORKS = read_toml(Path(__file__).parents[2] / "ci" / "matrix.toml")["frameworks"]["pins"]
"""The pinned versions: ``{"torch": "2.15", "transformers": "5.24", "accelerate": "1.15.0"}``."""


def _pin(version: str) -> SpecifierSet:
    """``5.24`` means the 5.24 line (``==5.24.*``); a full version means exactly it."""
    return SpecifierSet(f"=={version}.*" if version.count(".") == 1 else f"=={version}")


def missing(pins: Mapping[str, str], installed: Mapping[str, str | None]) -> str:
    """What ``installed`` (distribution -> version, ``None`` when absent) lacks of ``pins``,
    one ``dist PIN (installed)`` per distribution; "" when it has them all."""
    lacking = []
    for dist, version in sorted(pins.items()):
        have = installed.get(dist)
        if have is None or have not in _pin(version):
            lacking.append(f"{dist} {version} ({have or 'not installed'})")
    return ", ".join(lacking)


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def missing_versions() -> str:
    """What this environment lacks of the pinned versions ("" when it has them all)."""
    return missing(FRAMEWORKS, {dist: _installed(dist) for dist in FRAMEWORKS})


def frameworks_collected(config: pytest.Config) -> bool:
    """Whether this session collects the framework tests: ``--slow`` and the pinned versions."""
    return slow_tier_selected(config) and not missing_versions()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name.startswith("test_") and not frameworks_collected(config):
        return True
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    config = terminalreporter.config
    if slow_tier_selected(config) and missing_versions():
        terminalreporter.write_line(
            f"tests/frameworks not collected: it needs {missing_versions()}; "
            "`nox -s frameworks` installs them and runs it"
        )
