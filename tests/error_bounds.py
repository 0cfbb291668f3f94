"""The time bound of every row of docs/errors.md, in one place, and a way to record the figures.

Each test that triggers a row asserts one of the ``*_BOUND_S`` values below;
tests/test_errors_doc.py fails when the doc's "Time bound" column states another number for that
row. Bounds are generous on purpose (CI runners are slow and shared); what they rule out is an
error that waits for a process-group timeout, or for ever.

With ``FP32KEEP_ERROR_TIMES=FILE`` in the environment, the tests append what they measured to
FILE (one JSON object a line; the ranks inherit the variable), and
``python -m tests.error_bounds FILE`` prints the figures, slowest first.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

LIBRARY_BOUND_S: Final = 10.0
"""A library refusal: from the call to the exception, on the slowest rank."""

PARENT_BOUND_S: Final = 30.0
"""Decided in the pytest (or ``fp32keep``) process before any rank starts: a usage error, a
skip, a bad ``fp32keep check`` TARGET. Measured around the whole in-process run."""

RANK_FAULT_BOUND_S: Final = 30.0
"""A marked test whose rank raised, exited, died or ran out of memory: from the test's start
in the pytest process to its report (peers stuck in a collective are killed 3 s after)."""

INNER_FSDP_TIMEOUT_S: Final = 10
"""The ``--fsdp-timeout`` of the inner session that hangs (a setting, not a bound)."""

HANG_BOUND_S: Final = 40.0
"""A rank stuck in a collective: ``--fsdp-timeout`` (10 s in the test) plus 30 s for the
stack dump, the kill and the report."""

MARKER_TIMEOUT_BOUND_S: Final = 10.0
"""``@pytest.mark.fsdp2(timeout=3)`` ends a hanging test (below the session's 10 s timeout)."""

PYTEST_TIMEOUT_BOUND_S: Final = 10.0
"""pytest-timeout's ``@pytest.mark.timeout(3)`` ends a marked test whose ranks hang."""

INTERRUPT_BOUND_S: Final = 60.0
"""Ctrl-C (or SIGKILL) of the pytest process, or the death of an xdist worker, while ranks run:
from the signal until no process of the session is left."""

TIMES_VARIABLE: Final = "FP32KEEP_ERROR_TIMES"


def bounds() -> dict[str, float]:
    """Every bound of this module by name (the drift test matches test sources against it)."""
    module = sys.modules[__name__]
    return {name: float(getattr(module, name)) for name in dir(module) if name.endswith("_BOUND_S")}


def note_elapsed(seconds: float, what: str = "") -> None:
    """Append ``seconds`` for the running test to ``$FP32KEEP_ERROR_TIMES``, if it is set.

    The test is read from ``PYTEST_CURRENT_TEST`` (pytest sets it in the ranks too).
    """
    path = os.environ.get(TIMES_VARIABLE)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    line = json.dumps({"test": test, "what": what, "seconds": round(seconds, 3)})
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


@contextlib.contextmanager
def within(bound_s: float) -> Iterator[None]:
    """Require that the block ends within ``bound_s`` seconds, and record the time it took.

    Wrap the ``pytest.raises`` block (``with within(BOUND), pytest.raises(...)``); an exception
    that escapes the block propagates unmeasured.
    """
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed < bound_s, f"took {elapsed:.1f} s; the bound is {bound_s:g} s"
    note_elapsed(elapsed)


def summary(path: Path) -> str:
    """The recorded figures, slowest first, one per test and measurement."""
    slowest: dict[tuple[str, str], float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            entry = json.loads(line)
            key = (entry["test"], entry["what"])
            slowest[key] = max(slowest.get(key, 0.0), float(entry["seconds"]))
    rows = sorted(slowest.items(), key=lambda item: -item[1])
    return "\n".join(f"{seconds:8.3f} s  {test} {what}".rstrip() for (test, what), seconds in rows)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
