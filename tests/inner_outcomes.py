"""Reading an inner pytest session's junit XML: what each inner test's outcome really was.

A positive control must have *passed*: a junit ``<testcase>`` without a ``<failure>`` is not
enough, since an inner test whose fixture raised carries an ``<error>`` instead, and a skipped
one a ``<skipped>``; read as "not failed", both count as passing. :func:`junit_outcomes` gives
each test case one outcome from every element it carries, and :func:`assert_passed` accepts
only ``passed``. Negative controls read :attr:`InnerOutcome.text` of a ``failed`` one.
:func:`run_inner_session` writes an inner project, runs pytest on it in a subprocess and reads
the outcomes, the one way this project's tests run an inner session outside ``pytester``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
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


@dataclasses.dataclass(frozen=True)
class InnerSession:
    """One inner pytest session run by :func:`run_inner_session`.

    Attributes:
        outcomes: each inner test case's outcome, keyed by name (:func:`junit_outcomes`).
        report: the junit XML the session wrote (for a check that reads it another way).
        returncode: the inner pytest's exit status.
        output: its stdout, then its stderr.
    """

    outcomes: dict[str, InnerOutcome]
    report: Path
    returncode: int
    output: str


def run_inner_session(
    project: Path,
    files: Mapping[str, str],
    *args: str,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> InnerSession:
    """Write ``files`` (name to source) into ``project``, run ``pytest ARGS`` there in a
    subprocess with a junit report, and read every inner test's outcome.

    The inner session is a real one (the installed plugin, real ranks where it marks tests),
    without the cache provider (no ``.pytest_cache`` left to steer a later run), in ``env``
    (default: this process's environment); ``timeout`` bounds it. A session that wrote no
    report fails here, with its output.
    """
    for name, text in files.items():
        (project / name).write_text(text, encoding="utf-8")
    report = project / "inner-report.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    completed = subprocess.run(
        [*command, f"--junitxml={report.name}", *args],
        cwd=project,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert report.is_file(), (
        f"the inner pytest (exit {completed.returncode}) wrote no junit report:\n{output[-4000:]}"
    )
    return InnerSession(junit_outcomes(report), report, completed.returncode, output)
