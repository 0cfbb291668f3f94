"""The zoo entry a test needs, or a skip that says why the installed Transformers lacks it."""

from __future__ import annotations

import pytest

from pytest_fp32keep.check.zoo import ZOO, ZooEntry


def available_or_skip(name: str) -> ZooEntry:
    """``ZOO[name]`` when it builds under the installed Transformers; else skip the test with
    the entry's own reason (the family is missing from, or too new for, that release)."""
    entry = ZOO[name]
    if (reason := entry.unavailable_reason()) is not None:
        pytest.skip(reason)
    return entry
