"""The ranks' warnings, re-issued in the pytest process (the controller calls this per test)."""

from __future__ import annotations

import contextlib
import warnings

from pytest_fp32keep.runner import reports


class RankWarning(UserWarning):
    """A warning issued inside the ranks of a marked test, relayed to the pytest process."""


def relay_warnings(outcomes: list[reports.RankOutcome]) -> None:
    """Re-issue the ranks' warnings here, one per distinct text and place, naming the ranks.

    Each is issued at the file and line where the rank raised it (``warn_explicit``), so the
    warnings summary points at the user's code, not at this module. Called while pytest's
    warnings capture for the item is active (this plugin runs inside
    ``pytest_runtest_protocol``), so they appear in the summary under the test's id.
    """
    ranks_by_warning: dict[tuple[str, str, int], list[int]] = {}
    for outcome in outcomes:
        for warning in outcome.warnings:
            place = (str(warning["text"]), str(warning["filename"]), int(warning["lineno"]))
            ranks_by_warning.setdefault(place, []).append(outcome.rank)
    for (text, filename, lineno), ranks in ranks_by_warning.items():
        # Under -W error here the warning raises: the ranks ran with the same filters, so a
        # warning they only recorded is not one the user asked to fail on; drop it.
        with contextlib.suppress(RankWarning):
            warnings.warn_explicit(
                RankWarning(f"[{reports.ranks_text(ranks)}] {text}"), RankWarning, filename, lineno
            )
