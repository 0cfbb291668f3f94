"""``fp32keep check`` merges every rank's verdict (issue 14): a case passes only if it passed on
every rank; a row the ranks disagree on names the ranks that failed and how; the JSON keeps each
rank's outcome.

The merge and its rendering, pure, on case dicts shaped as the ranks make them. The real run in
2 ranks of a model whose build differs on rank 1 (``tests/cli/rank_targets.py``) is one target of
``tests/cli/test_cli.py``'s shared run (``test_a_model_that_differs_on_rank_1_fails_there_alone``):
before this merge, rank 0's verdict alone was written, and it passed.
"""

from __future__ import annotations

from typing import Any

from pytest_fp32keep.check.rank_verdicts import disagreement, merge_case
from pytest_fp32keep.check.render import case_result, render_markdown, render_text
from tests.cli.test_cli import _case, _result

TRIP = {
    "check": "round trip",
    "subject": "table",
    "expected": "bfloat16",
    "observed": "bfloat16 (values differ)",
    "ok": False,
}


def _failing(outcome: str = "fail", **extra: Any) -> dict[str, Any]:
    case = _case("m:build", kept=2, outcome=outcome, ok=False, **extra)
    if outcome == "fail":
        case["status"] = {check: check != "round trip" for check in case["status"]}
        case["failures"] = [dict(TRIP)]
    return case


def test_ranks_that_agree_give_rank_0s_row_with_every_ranks_outcome() -> None:
    merged = merge_case([_case("m:build", kept=2), _case("m:build", kept=2)])
    assert merged["ok"] and merged["ranks_agree"]
    assert [o["rank"] for o in merged["rank_outcomes"]] == [0, 1]
    assert case_result(merged) == "pass"
    both = merge_case([_failing(), _failing()])
    assert not both["ok"] and both["ranks_agree"] and both["failed_ranks"] == [0, 1]
    assert case_result(both) == "FAIL"  # every rank failed alike: no rank to single out
    assert disagreement(both) == ""


def test_one_rank_failing_fails_the_case_naming_the_rank() -> None:
    per_rank = [_case("m:build", kept=2), _failing()]
    # negative control: rank 0's verdict alone (what the command wrote before) passes
    assert per_rank[0]["ok"]
    merged = merge_case(per_rank)
    assert not merged["ok"] and not merged["ranks_agree"]
    assert merged["outcome"] == "fail" and merged["failed_ranks"] == [1]
    assert merged["status"]["round trip"] is False and merged["status"]["parity"] is True
    assert merged["failures"] == [{**TRIP, "ranks": [1]}]
    assert case_result(merged) == "FAIL (rank 1)"
    assert disagreement(merged) == "rank 1: fail (round trip); rank 0: pass"
    assert [(o["rank"], o["ok"]) for o in merged["rank_outcomes"]] == [(0, True), (1, False)]


def test_an_error_on_one_rank_is_the_rows_outcome_with_its_message() -> None:
    crashed = _failing("error", message="Traceback ...\nRuntimeError: rank 1 ran out")
    merged = merge_case([_case("m:build"), _case("m:build"), crashed])
    assert merged["outcome"] == "error" and case_result(merged) == "ERROR (rank 2)"
    assert merged["message"] == "[rank 2] Traceback ...\nRuntimeError: rank 1 ran out"
    assert disagreement(merged) == "rank 2: error; ranks 0,1: pass"


def test_terminal_and_markdown_say_which_rank_failed_and_how() -> None:
    result = _result([merge_case([_case("m:build", kept=2), _failing()])])
    text = render_text(result, 100)
    assert "FAIL (rank 1)" in " ".join(text.split())
    assert "- ranks disagree: rank 1: fail (round trip); rank 0: pass" in text
    assert (
        "`round trip` table [rank 1]: expected bfloat16, observed bfloat16 (values differ)" in text
    )
    markdown = render_markdown(result)
    assert "| m:build | fp16 | autocast | FAIL (rank 1) |" in markdown
    assert "- ranks disagree: rank 1: fail (round trip); rank 0: pass" in markdown


def test_a_check_that_ran_on_no_rank_stays_not_run_and_one_that_failed_anywhere_fails() -> None:
    # After a crashed step its checks have no finding (status None on that rank): the merged
    # row shows "-" for them, not "pass"; a check that ran and failed on one rank fails.
    crashed = _failing()
    crashed["status"] = {**crashed["status"], "parity": None, "round trip": False}
    other = _failing()
    other["status"] = {**other["status"], "parity": None, "round trip": None}
    merged = merge_case([crashed, other])
    assert merged["status"]["parity"] is None
    assert merged["status"]["round trip"] is False
    assert merged["status"]["stored"] is True
