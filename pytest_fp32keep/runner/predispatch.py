"""Pre-dispatch: the next marked test goes to its ranks before the parent handles the last one.

After a test passes in every rank, the ranks would idle while the parent decodes and merges
their reports, logs them through pytest's hooks (the terminal), starts the next item's protocol
and decides it. When nothing of that can change what the next test does, the controller sends
the next test as soon as every rank's ``done`` is in, and handles the passed one while the
ranks already run the next; the next item's protocol then only waits for its results
(:class:`Predispatched`).

The conditions are all decided on what the parent already knows:

- the test passed in every phase on every rank, read from the phase reports as they arrived,
  before they are decoded (:meth:`~pytest_fp32keep.runner.flight.Flight.passed_everywhere`: a
  failure, an error, a skip or an xfail may stop the session: ``-x``, ``--maxfail``) and pytest
  is not already stopping;
- pytest's own loop decides the order (not under xdist, whose worker learns its next test as
  it goes) and the next test is marked, of the same group, not ``isolated``, and runs here: no
  invalid marker, no placement skip, and its ``skip``/``skipif``/``xfail(run=False)`` marks,
  evaluated now (once: its protocol does not evaluate them again), do not stop it
  (:func:`may_send`);
- the parent's own teardown between the two tests does nothing (:func:`parent_teardown_is_noop`):
  a finaliser that fails there would be an error of the passed test.

What the next test's run message carries is what its own protocol would send: its seed (a
function of its node id), its timeout (counted from this dispatch, when the ranks start it) and
the test after it (from the run order planned at collection, which is pytest's own loop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from _pytest.skipping import evaluate_skip_marks, evaluate_xfail_marks

from pytest_fp32keep.runner.flight import Flight
from pytest_fp32keep.runner.launcher import RankGroup


@dataclasses.dataclass(frozen=True)
class Predispatched:
    """A test already sent to its ranks, waiting for its protocol to collect the results."""

    nodeid: str
    group: RankGroup
    flight: Flight


def successors(items: Sequence[pytest.Item]) -> dict[str, str | None]:
    """Each node id's successor in pytest's loop; nothing where node ids repeat (ambiguous)."""
    ids = [item.nodeid for item in items]
    if len(set(ids)) != len(ids):
        return {}
    return dict(zip(ids, [*ids[1:], None], strict=True))


def may_send(item: pytest.Item, nextitem: pytest.Item, config: pytest.Config) -> bool:
    """Whether, ``item`` having passed on every rank, nothing left to do for it in the parent
    can stop ``nextitem`` or change how it runs (placement is the controller's to check)."""
    if hasattr(config, "workerinput"):
        return False  # under xdist the worker learns its next test as it goes
    if stopping(item.session):
        return False
    return parent_teardown_is_noop(item, nextitem) and runs_in_ranks(nextitem, config)


def dropped(nodeid: str) -> str:
    """The warning when a test sent ahead was not the next one pytest ran."""
    return (
        f"fsdp2: {nodeid} was sent to its ranks ahead of time, but pytest did not run it "
        "next; its result is dropped"
    )


def stopping(session: pytest.Session) -> bool:
    """Whether pytest will end the run after this test whatever it reported."""
    return bool(session.shouldstop or session.shouldfail)


def parent_teardown_is_noop(item: pytest.Item, nextitem: pytest.Item) -> bool:
    """Whether ``SetupState.teardown_exact(nextitem)`` after ``item`` finalises nothing.

    Mirrors pytest's rule: it stops popping as soon as the stack is a prefix of the next
    item's chain. Without the (private) stack, assume it may do something.
    """
    setupstate = getattr(item.session, "_setupstate", None)
    stack = getattr(setupstate, "stack", None)
    if stack is None:
        return False
    if not stack:
        return True
    nodes = list(stack.keys())
    return nodes == nextitem.listchain()[: len(nodes)]


def runs_in_ranks(item: pytest.Item, config: pytest.Config) -> bool:
    """Whether the parent's ``skip``/``skipif``/``xfail(run=False)`` marks let ``item`` run.

    A condition that cannot be evaluated counts as "no": the item's own protocol evaluates it
    again and reports the error.
    """
    try:
        if evaluate_skip_marks(item) is not None:
            return False
        xfail = evaluate_xfail_marks(item)
    except (Exception, pytest.fail.Exception):  # a bad condition; its protocol reports it
        return False
    return xfail is None or xfail.run or bool(config.option.runxfail)
