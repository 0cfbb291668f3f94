"""Messages that name keys, parameters or problems stay a few KB, whatever their number.

A state dict of 2 M unexpected keys gave a 45 MB ``StateDictError`` message (16 s on a rank),
built on every rank; a model with thousands of layout problems a line per problem. Now each
list names the first few (``fp32keep.reprs.SHOWN``) and counts the rest, while the error's
attributes (``error.unexpected``, ``error.problems``) still hold every one. Pure: the refusals
are built from the data every rank agreed on, so no rank is needed here
(tests/multirank/test_load_refusals_fsdp2.py loads such a dict on real ranks).
"""

from __future__ import annotations

import pytest

from fp32keep import KeepLayoutError, LayoutProblem, StateDictError
from fp32keep.load.validate import Verdict, verdict_error
from fp32keep.plan.constructed import plan_divergence
from fp32keep.reprs import SHOWN, first_few, first_lines
from tests.error_bounds import LIBRARY_BOUND_S, within

#: The most a refusal naming any number of keys may weigh (its fixed sentences included).
MESSAGE_LIMIT = 4096

UNEXPECTED = 2_000_000


def huge_verdict() -> Verdict:
    return Verdict(
        missing=tuple(f"layers.{i}.wo.weight" for i in range(3000)),
        unexpected=tuple(f"extra.{i}.weight" for i in range(UNEXPECTED)),
        mismatched=tuple((f"layers.{i}.wi.weight", "has shape (3, 8)") for i in range(3000)),
    )


def unbounded_text(verdict: Verdict) -> str:
    """The refusal as it was built before (the known-wrong implementation): every key."""
    return f"unexpected keys ({len(verdict.unexpected)}): {list(verdict.unexpected)}"


def test_two_million_unexpected_keys_give_a_message_of_a_few_kb() -> None:
    verdict = huge_verdict()
    with within(LIBRARY_BOUND_S):
        error = verdict_error(verdict, strict=True, src_rank=0)
    assert isinstance(error, StateDictError)
    text = str(error)
    assert len(text) < MESSAGE_LIMIT, len(text)
    assert (
        "unexpected keys (2000000): ['extra.0.weight', 'extra.1.weight', 'extra.2.weight', "
        "'extra.3.weight', 'extra.4.weight'] … and 1999995 more" in text
    )
    assert "missing keys (3000): ['layers.0.wo.weight'," in text
    assert "'layers.4.wo.weight'] … and 2995 more" in text
    assert "entries that cannot be loaded (3000):\n  layers.0.wi.weight: has shape (3, 8)" in text
    assert "\n  … and 2995 more\n" in text
    assert "layers.5.wi.weight" not in text and "extra.5.weight" not in text
    # the attributes still hold every key: only the message is bounded
    assert len(error.unexpected) == UNEXPECTED and len(error.missing) == 3000
    assert len(error.mismatched) == 3000


def test_the_unbounded_message_fails_the_limit() -> None:
    """Negative control: the old text for the same verdict is far over the limit."""
    assert len(unbounded_text(huge_verdict())) > 1000 * MESSAGE_LIMIT


def test_few_keys_are_all_named_without_a_count() -> None:
    verdict = Verdict(unexpected=("a.weight",), missing=tuple(f"m{i}" for i in range(SHOWN)))
    text = str(verdict_error(verdict, strict=True, src_rank=0))
    assert "unexpected keys (1): ['a.weight']" in text
    assert "missing keys (5): ['m0', 'm1', 'm2', 'm3', 'm4']" in text and "more" not in text


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, "[]"),
        (SHOWN, "['k0', 'k1', 'k2', 'k3', 'k4']"),
        (SHOWN + 1, "['k0', 'k1', 'k2', 'k3', 'k4'] … and 1 more"),
    ],
)
def test_first_few_counts_only_what_it_leaves_out(count: int, expected: str) -> None:
    assert first_few([f"k{i}" for i in range(count)]) == expected


def test_first_few_clips_a_huge_key_and_first_lines_counts_the_rest() -> None:
    assert len(first_few(["x" * 1_000_000])) < 300
    lines = [f"  line {i}" for i in range(SHOWN + 2)]
    assert first_lines(lines) == [*lines[:SHOWN], "  … and 2 more"]
    assert first_lines(lines[:SHOWN]) == lines[:SHOWN]


def test_thousands_of_layout_problems_name_a_few_of_each_reason() -> None:
    problems = [
        LayoutProblem(f"layers.{i}.norm.weight", "degraded", "is bf16") for i in range(3000)
    ]
    problems.append(LayoutProblem("gains.0", "root-owned", "no unit owns it"))
    with within(LIBRARY_BOUND_S):
        error = KeepLayoutError(problems, model_name="Big")
    text = str(error)
    assert len(text) < MESSAGE_LIMIT, len(text)
    assert text.startswith("FSDP2 cannot keep the FP32 contract of Big: 3001 problem(s)")
    assert "layers.4.norm.weight" in text and "layers.5.norm.weight" not in text
    assert "[root-owned] no unit owns it" in text  # a rarer reason after many is still shown
    assert "… and 2995 more [degraded] (error.problems lists every one)" in text
    assert len(error.problems) == 3001 and error.fqns[-1] == "gains.0"


def test_a_plan_divergence_over_a_thousand_ranks_stays_short() -> None:
    accounts = [(0, "a", ())] + [(r, "b", ("rebuild failed (OSError)",)) for r in range(1, 1000)]
    text = plan_divergence("apply_fsdp2", accounts) or ""
    assert len(text) < MESSAGE_LIMIT, len(text)
    assert "the keep plan on ranks [1, 2, 3, 4, 5] … and 994 more differs from rank 0's" in text
    assert "rank 1: rebuild failed (OSError)" in text and "and 994 more ranks" in text
