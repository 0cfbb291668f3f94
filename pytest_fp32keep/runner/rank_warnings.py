"""The ranks' warnings, re-issued in the pytest process (the controller calls this per test)."""

from __future__ import annotations

import contextlib
import textwrap
import warnings
from typing import Final

from pytest_fp32keep.runner import reports


class RankWarning(UserWarning):
    """A warning issued inside the ranks of a marked test, relayed to the pytest process."""


#: The widest line of a relayed warning's text in pytest's warnings summary (which indents each
#: line of a message by 2 columns): a terminal's 100 columns.
WARNING_WIDTH: Final = 100
#: A text at most this long stays on the line of its place and ranks, as the rank wrote it.
SHORT_TEXT: Final = 80


def warning_message(ranks: list[int], text: str) -> str:
    """``"[ranks 0,1] TEXT"``: the ranks that raised ``text``, each named once. A text longer
    than :data:`SHORT_TEXT` (torch's FSDP2 view-tensor warning is about 450 columns) starts on
    the next line, wrapped to fit :data:`WARNING_WIDTH` in the summary, its own line breaks
    kept."""
    named = f"[{reports.ranks_text(sorted(set(ranks)))}]"
    if len(text) <= SHORT_TEXT and "\n" not in text:
        return f"{named} {text}"
    room = WARNING_WIDTH - 4  # pytest's indent of 2 and ours
    lines = [
        piece
        for line in text.splitlines()
        for piece in textwrap.wrap(line, room, break_on_hyphens=False) or [""]
    ]
    return "\n".join([named, *("  " + line for line in lines)])


def relay_warnings(outcomes: list[reports.RankOutcome]) -> None:
    """Re-issue the ranks' warnings here, one per distinct text and place, naming the ranks
    (each once, however often it raised the warning: :func:`warning_message`).

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
                RankWarning(warning_message(ranks, text)), RankWarning, filename, lineno
            )
