"""The durations pytest is told for a marked test: the time it took, not only the ranks' share.

The ranks time each phase of the test themselves, but two things happen outside those phases
and would be missing from ``--durations`` and from the JUnit ``time``: the start-up of the ranks
(torchrun, the imports, the process group), paid by the test that started them; and a test
that never finished in its ranks (a hang, a rank that died), whose missing phase was filled in
by the controller with no duration. :class:`PhaseClock` collects what the controller measured
while one marked test ran, and :meth:`PhaseClock.timed` puts it on that test's reports: the
start-up into its setup, and the wall time the ranks had the test (until it was declared hung,
for a hang) into its call, where the phases the ranks reported add up to less.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest


class PhaseClock:
    """What the controller measured while the marked test being reported ran."""

    def __init__(self) -> None:
        self._startup = 0.0
        self._waited: dict[str, float] = {}

    def reset(self) -> None:
        """Forget the last test's measurements: a new test is being reported."""
        self._startup = 0.0
        self._waited.clear()

    def launched(self, seconds: float) -> None:
        """A group of ranks took ``seconds`` to start for the test being reported."""
        self._startup += seconds

    def waited(self, nodeid: str, seconds: float) -> None:
        """The ranks had the test ``nodeid`` for ``seconds``, from its send to its verdict."""
        self._waited[nodeid] = seconds

    def timed(
        self, nodeid: str, reports: Sequence[pytest.TestReport]
    ) -> Sequence[pytest.TestReport]:
        """``reports`` (one test's, in phase order), their durations completed in place."""
        by_phase = {report.when: report for report in reports}
        ranks_share = sum(report.duration for report in reports)
        shortfall = self._waited.get(nodeid, 0.0) - ranks_share
        # The phase that failed (cut short by a hang), else the call.
        failed = [report for report in reports if report.failed]
        charged = failed[0] if failed else by_phase.get("call") or by_phase.get("setup")
        if charged is not None and shortfall > 0:
            charged.duration += shortfall
        if "setup" in by_phase:
            by_phase["setup"].duration += self._startup
        return reports
