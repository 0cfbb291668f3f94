"""Reading an inner pytest session's junit XML: what each inner test's outcome really was.

A positive control must have *passed*: a junit ``<testcase>`` without a ``<failure>`` is not
enough, since an inner test whose fixture raised carries an ``<error>`` instead, and a skipped
one a ``<skipped>``; read as "not failed", both count as passing. :func:`junit_outcomes` gives
each test case one outcome from every element it carries, and :func:`assert_passed` accepts
only ``passed``. Negative controls read :attr:`InnerOutcome.text` of a ``failed`` one.
"""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Literal

Outcome = Literal["passed", "failed", "error", "skipped"]

#: The junit elements that make a test case anything but passed, worst first. A test can carry
#: several (a failing call and an erroring teardown): the worst one names its outcome.
_ELEMENTS: tuple[tuple[str, Outcome], ...] = (
    ("error", "error"),
    ("failure", "failed"),
    ("skipped", "skipped"),
)


@dataclasses.dataclass(frozen=True)
class InnerOutcome:
    """One inner test case as junit XML recorded it.

    Attributes:
        name: the test case's name (``test_x`` or ``test_x[param]``).
        outcome: ``passed`` only when the case carries no error, failure or skipped element.
        text: every such element's message and text, in document order (empty when passed).
    """

    name: str
    outcome: Outcome
    text: str = ""


def junit_outcomes(path: Path) -> dict[str, InnerOutcome]:
    """Each test case of the junit XML at ``path`` (keyed by name) with its outcome.

    pytest writes a second ``<testcase>`` of the same name for an error at teardown of a test
    that already failed or passed: both are read, and the worst element names the outcome.
    """
    present: dict[str, list[ET.Element]] = {}
    for case in ET.parse(path).iter("testcase"):
        found = present.setdefault(case.attrib["name"], [])
        found += [child for child in case if child.tag in dict(_ELEMENTS)]
    outcomes: dict[str, InnerOutcome] = {}
    for name, elements in present.items():
        outcome: Outcome = next(
            (kind for tag, kind in _ELEMENTS if any(e.tag == tag for e in elements)), "passed"
        )
        text = "\n".join(f"<{e.tag}> {e.get('message', '')}\n{e.text or ''}" for e in elements)
        outcomes[name] = InnerOutcome(name, outcome, text)
    return outcomes


def assert_passed(outcome: InnerOutcome) -> None:
    """Fail unless the inner test passed: not failed, not errored, not skipped."""
    assert outcome.outcome == "passed", (
        f"the inner positive control {outcome.name} {outcome.outcome} instead of passing:\n"
        f"{outcome.text[-4000:]}"
    )
