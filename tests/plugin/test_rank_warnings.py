"""Rank warnings are issued at the file and line where the rank raised them (issue 22), pure.

tests/plugin/test_hygiene.py checks the same through a real inner session (the user's test file
and line in the summary, ``runner/controller.py`` nowhere); these pin down the rule itself, with
its negative control: one text raised in two places is two warnings, each at its own place, so
the place is the rank's, never a fixed one (the test's file, or the runner's).
"""

from __future__ import annotations

import warnings

from pytest_fp32keep.runner import reports
from pytest_fp32keep.runner.protocol import rank_warning
from pytest_fp32keep.runner.rank_warnings import RankWarning, relay_warnings

USER_FILE = "/home/me/project/test_my_model.py"
LIBRARY_FILE = "/venv/site-packages/somelib/modeling.py"


def relayed(*outcomes: reports.RankOutcome) -> list[tuple[str, str, int]]:
    """What :func:`relay_warnings` issues: message, file and line of each warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relay_warnings(list(outcomes))
    assert all(issubclass(w.category, RankWarning) for w in caught)
    return [(str(w.message), w.filename, w.lineno) for w in caught]


def test_identical_rank_warnings_are_one_at_the_users_file_and_line() -> None:
    careful = rank_warning("UserWarning: careful with this model", USER_FILE, 12)
    both = [reports.RankOutcome(rank, warnings=[careful]) for rank in (0, 1)]
    assert relayed(*both) == [("[ranks 0,1] UserWarning: careful with this model", USER_FILE, 12)]


def test_negative_control_one_text_from_two_places_is_two_warnings_at_their_places() -> None:
    text = "UserWarning: careful with this model"
    here = reports.RankOutcome(0, warnings=[rank_warning(text, USER_FILE, 12)])
    there = reports.RankOutcome(1, warnings=[rank_warning(text, LIBRARY_FILE, 40)])
    assert relayed(here, there) == [
        (f"[rank 0] {text}", USER_FILE, 12),
        (f"[rank 1] {text}", LIBRARY_FILE, 40),
    ]


def test_a_warning_raised_twice_in_each_rank_names_each_rank_once() -> None:
    # torch warns about a view once per unit: the same text at the same place, twice a rank
    twice = [rank_warning("UserWarning: a view", LIBRARY_FILE, 40)] * 2
    ranks = [reports.RankOutcome(rank, warnings=twice) for rank in (0, 2)]
    assert relayed(*ranks) == [("[ranks 0,2] UserWarning: a view", LIBRARY_FILE, 40)]
    # negative control: a rank that did not raise it is not named
    assert relayed(reports.RankOutcome(1, warnings=twice)) == [
        ("[rank 1] UserWarning: a view", LIBRARY_FILE, 40)
    ]


def test_a_long_warning_starts_on_its_own_line_wrapped_to_100_columns() -> None:
    text = "UserWarning: FSDP2-wrapped module (Block) returned a view tensor. " + " ".join(
        ["An in-place op on this view will silently drop the pre-backward hook."] * 6
    )
    (message, _, _), *_ = relayed(
        reports.RankOutcome(0, warnings=[rank_warning(text, USER_FILE, 3)])
    )
    lines = message.splitlines()
    assert lines[0] == "[rank 0]"
    # pytest's summary indents each line of a message by 2 columns
    assert max(len("  " + line) for line in lines) <= 100, message
    assert " ".join(" ".join(lines[1:]).split()) == text  # nothing lost
    # negative control: a short text stays on the line of its ranks (the first test above too)
    short = "UserWarning: careful"
    (message, _, _), *_ = relayed(
        reports.RankOutcome(0, warnings=[rank_warning(short, USER_FILE, 3)])
    )
    assert message == f"[rank 0] {short}"
