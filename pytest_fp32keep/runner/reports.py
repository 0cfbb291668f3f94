"""Merging what the ranks report into one pytest report per phase.

Pure functions over data: no sockets, no processes. The controller hands in, per rank, the
phase reports that came back and, where a rank did not finish, a :class:`RankFault` saying why
(it died, it was stuck after a peer failed, it timed out ...). Out come the ``TestReport``
objects pytest logs for the test.

Rules (each one a promise of the issue):

- a phase passes only if every rank passed it;
- on failure the earliest failing rank is the root cause: its traceback comes first, then every
  other failing rank's, with identical tracebacks merged into one entry ("ranks 0,1"), after
  normalising addresses, rank numbers in paths, ports and temporary folders, and without the
  contract library's own frames (:mod:`.tracebacks`);
  ranks that were only stuck or killed because of it are listed after, with their stacks;
- a skip counts only if every rank skipped; a partial skip is a failure naming the ranks;
- xfail follows pytest: all ranks xfailed -> XFAIL; an expected failure seen on some ranks
  while the others passed (non-strict) is still XFAIL; strict XPASS fails on every rank;
- captured output of every rank is kept, in sections named ``... [rank N]``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Literal

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr
from _pytest._io import TerminalWriter

from pytest_fp32keep.runner.tracebacks import (
    condense_stacks,
    hide_library_frames,
    mask_rank_values,
    merge_key,
    wrap_error_lines,
)

Phase = Literal["setup", "call", "teardown"]

#: A rank that died counts as failing this much earlier than its death was observed, so that
#: a peer's collective error caused by the death ("Connection closed by peer") never becomes
#: the root cause instead of it.
DEATH_PRECEDENCE_S: Final = 1.0
PHASES: Final[tuple[Phase, ...]] = ("setup", "call", "teardown")
#: What a block of several ranks shows as the value of ``fsdp2_rank`` (and ``fsdp2_device``).
PER_RANK_SHOWN: Final = "<per rank>"


@dataclasses.dataclass(frozen=True)
class ItemInfo:
    """What a report needs to know about the parent's item.

    ``where`` gives the file and 1-based line a failure or skip report points at. It is a call,
    made at most once and only when such a report is built: pytest's ``reportinfo`` looks the
    test function up again on every call (``item.location``, which every test needs, caches its
    own call but not this one), and most tests pass.
    """

    nodeid: str
    location: tuple[str, int | None, str]
    keywords: dict[str, Literal[1]]
    where: Callable[[], tuple[str, int]] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_item(cls, item: pytest.Item) -> ItemInfo:
        """Capture the parent's view of ``item`` (rank reports are rebuilt on it)."""

        def where() -> tuple[str, int]:
            path, lineno = item.reportinfo()[:2]
            return os.fspath(path), (lineno or 0) + 1

        return cls(
            nodeid=item.nodeid,
            location=item.location,
            keywords=dict.fromkeys(item.keywords, 1),
            where=where,
        )

    @functools.cached_property
    def _place(self) -> tuple[str, int]:
        return self.where()

    @property
    def path(self) -> str:
        """The file a failure or skip report names."""
        return self._place[0]

    @property
    def lineno(self) -> int:
        """The 1-based line a failure or skip report names."""
        return self._place[1]


@dataclasses.dataclass(frozen=True)
class RankFault:
    """Why a rank has no complete result for the test.

    Attributes:
        kind: ``"died"``, ``"stuck"`` (killed while a peer had failed or died), ``"timeout"``,
            ``"interrupted"`` (an outside timeout fired), ``"missing"`` (no such test in the
            rank), ``"internal"`` (pytest's protocol raised in the rank), ``"error"`` (the test
            left the rank unusable, or a kept fixture failed to tear down before it).
        detail: one line for the report, without the rank (the report's title names the
            ranks, and identical accounts of several ranks merge): "killed by signal 9 ...".
        summary: the same without the rank, for the headline when no rank failed by itself
            ("still running after --fsdp-timeout=5 s").
        at: wall-clock time of the fault (``time.time()``), for picking the root cause.
        consequence: the fault only followed another rank's failure (stuck in a collective,
            terminated by torchrun); such ranks are never the root cause.
        stack: the rank's Python stacks when it was dumped.
        log_tail: the end of the rank's own log (fatal errors land there).
    """

    kind: str
    detail: str
    summary: str = ""
    at: float = math.inf
    consequence: bool = False
    stack: str = ""
    log_tail: str = ""


@dataclasses.dataclass
class RankOutcome:
    """Everything one rank produced for one test."""

    rank: int
    reports: list[pytest.TestReport] = dataclasses.field(default_factory=list)
    # Phase reports as the rank serialised them, not yet decoded into ``reports``: the
    # controller may send the next test before it decodes (``Flight.decode_reports``).
    serialized: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    finished: bool = False
    fault: RankFault | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # rank_warning

    def phase(self, when: Phase) -> pytest.TestReport | None:
        """This rank's report for ``when``, if it made one."""
        for report in self.reports:
            if report.when == when:
                return report
        return None

    def charged_phase(self) -> Phase | None:
        """The phase a faulted rank was in: the first one it should have reported and did not."""
        if self.fault is None:
            return None
        setup = self.phase("setup")
        if setup is None:
            return "setup"
        if setup.passed and self.phase("call") is None:
            return "call"
        return "teardown"


@dataclasses.dataclass(frozen=True)
class _Member:
    """One rank's part in one merged phase."""

    rank: int
    report: pytest.TestReport | None
    fault: RankFault | None

    @property
    def failing(self) -> bool:
        return self.fault is not None or (self.report is not None and self.report.failed)

    @property
    def failed_at(self) -> float:
        """When the rank failed by itself; consequences sort last, never root cause."""
        if self.fault is not None:
            if self.fault.consequence:
                return math.inf
            if self.fault.kind == "died":
                # A death is seen when its socket closes, a moment after it happened; a peer
                # that errors in a collective because of it may report before that.
                return self.fault.at - DEATH_PRECEDENCE_S
            return self.fault.at
        assert self.report is not None
        return float(getattr(self.report, "stop", 0.0) or 0.0)


def _is_consequence(member: _Member) -> bool:
    return member.fault is not None and member.fault.consequence


def _is_xfailed(report: pytest.TestReport) -> bool:
    return report.skipped and hasattr(report, "wasxfail")


def ranks_text(ranks: Iterable[int]) -> str:
    """``"rank 1"`` or ``"ranks 0,2"``."""
    numbers = sorted(ranks)
    label = "rank" if len(numbers) == 1 else "ranks"
    return f"{label} {','.join(map(str, numbers))}"


def _plain(renderable: Any) -> str:
    """A longrepr (or text) as plain text, the way junitxml and ``longreprtext`` see it."""
    if renderable is None:
        return ""
    if hasattr(renderable, "toterminal"):
        out = io.StringIO()
        writer = TerminalWriter(file=out)
        writer.hasmarkup = False
        renderable.toterminal(writer)
        return out.getvalue().rstrip("\n")
    return str(renderable).rstrip("\n")


@dataclasses.dataclass
class _Entry:
    """One block of the merged failure: ranks with an identical account of what happened."""

    ranks: list[int]
    longrepr: Any
    text: str
    root: bool = False

    def key(self) -> str:
        # Each rank's fsdp2_rank differs by design: not a difference between their failures.
        return merge_key(_plain(mask_rank_values(self.longrepr, "?")) + "\n" + self.text)


class RankFailureRepr(TerminalRepr):
    """The longrepr of a merged failure: a headline, the root cause first, then the rest.

    Renders the ranks' own tracebacks with their native ``toterminal`` (colours, ``--tb``
    style as the ranks produced it); ``str()`` gives the same as plain text for junitxml.
    ``reprcrash`` is the root cause's, prefixed with its rank, for ``-r`` summaries.
    """

    def __init__(self, headline: str, entries: Sequence[_Entry], reprcrash: Any) -> None:
        self.headline = headline
        self.entries = list(entries)
        self.reprcrash = reprcrash

    def toterminal(self, tw: TerminalWriter) -> None:
        """Write the headline, then one titled block per group of identical ranks."""
        tw.line(self.headline, red=True, bold=True)
        for entry in self.entries:
            title = ranks_text(entry.ranks)
            if entry.root:
                title += " (root cause: first to fail)"
            tw.sep("-", title)
            if entry.longrepr is not None:
                if hasattr(entry.longrepr, "toterminal"):
                    entry.longrepr.toterminal(tw)
                else:
                    tw.line(str(entry.longrepr))
            if entry.text:
                tw.line(entry.text)


def _fault_text(fault: RankFault) -> str:
    parts = [fault.detail]
    if fault.stack:
        parts.append(
            "Python stacks of the rank when it was stopped:\n" + condense_stacks(fault.stack)
        )
    if fault.log_tail:
        parts.append("End of the rank's log:\n" + fault.log_tail.rstrip())
    return "\n".join(parts)


def _rank_sections(members: Sequence[_Member]) -> list[tuple[str, str]]:
    sections: list[tuple[str, str]] = []
    for member in sorted(members, key=lambda m: m.rank):
        if member.report is not None:
            rank = member.rank
            sections += [(f"{name} [rank {rank}]", body) for name, body in member.report.sections]
    return sections


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple | list) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return getattr(report, "wasxfail", "") or _plain(longrepr)


def _make_report(
    info: ItemInfo,
    when: Phase,
    outcome: Literal["passed", "failed", "skipped"],
    longrepr: Any,
    members: Sequence[_Member],
    *,
    wasxfail: str | None = None,
    extra_sections: Sequence[tuple[str, str]] = (),
) -> pytest.TestReport:
    reports = [m.report for m in members if m.report is not None]
    starts = [r.start for r in reports if getattr(r, "start", 0)]
    stops = [r.stop for r in reports if getattr(r, "stop", 0)]
    properties: list[tuple[str, object]] = []
    for report in reports:
        properties += [p for p in report.user_properties if p not in properties]
    report = pytest.TestReport(
        info.nodeid,
        info.location,
        info.keywords,
        outcome,
        longrepr,
        when,
        sections=[*_rank_sections(members), *extra_sections],
        duration=max((r.duration for r in reports), default=0.0),
        start=min(starts, default=0.0),
        stop=max(stops, default=0.0),
        user_properties=properties,
    )
    if wasxfail is not None:
        report.wasxfail = wasxfail
    return report


def _failure(
    info: ItemInfo, when: Phase, members: Sequence[_Member], world_size: int
) -> pytest.TestReport:
    failing = sorted((m for m in members if m.failing), key=lambda m: (m.failed_at, m.rank))
    passing = sorted(m.rank for m in members if not m.failing and m.report and m.report.passed)
    skipping = [m for m in members if not m.failing and m.report and m.report.skipped]
    root = failing[0] if not math.isinf(failing[0].failed_at) else None

    entries: list[_Entry] = []
    for member in failing:
        longrepr = (
            wrap_error_lines(hide_library_frames(member.report.longrepr)) if member.report else None
        )
        text = _fault_text(member.fault) if member.fault is not None else ""
        entry = _Entry([member.rank], longrepr, text, root=member is root)
        same = next((e for e in entries if e.key() == entry.key()), None)
        if same is not None:
            same.ranks.append(member.rank)
            same.longrepr = mask_rank_values(same.longrepr, PER_RANK_SHOWN)
        else:
            entries.append(entry)
    for member in skipping:
        assert member.report is not None
        how = "xfailed" if _is_xfailed(member.report) else "skipped"
        entries.append(_Entry([member.rank], None, f"{how}: {_skip_reason(member.report)}"))

    headline = f"fsdp2: {when} failed on {ranks_text(m.rank for m in failing)} of {world_size}"
    others = [f"{ranks_text(passing)} passed"] if passing else []
    if skipping:
        others.append(f"{ranks_text(m.rank for m in skipping)} skipped")
    if others:
        headline += f" ({', '.join(others)})"
    if root is not None:
        headline += f"; root cause: rank {root.rank} (first to fail)"
    else:
        reasons = sorted({m.fault.summary or m.fault.kind for m in failing if m.fault})
        headline += "; no rank failed by itself: " + "; ".join(reasons)

    # The -r summary line and junitxml's failure message read reprcrash.message.
    reprcrash = ReprFileLocation(info.path, info.lineno, headline)
    if root is not None:
        who = ranks_text(next(e.ranks for e in entries if e.root))
        crash: Any = getattr(root.report.longrepr, "reprcrash", None) if root.report else None
        if isinstance(crash, ReprFileLocation):
            reprcrash = dataclasses.replace(crash, message=f"[{who}] {crash.message}")
        elif root.fault is not None:
            reprcrash = ReprFileLocation(info.path, info.lineno, f"[{who}] {root.fault.detail}")
    return _make_report(
        info, when, "failed", RankFailureRepr(headline, entries, reprcrash), members
    )


def _merge_phase(
    info: ItemInfo, when: Phase, members: Sequence[_Member], world_size: int
) -> pytest.TestReport:
    by_themselves = [m for m in members if m.failing and not _is_consequence(m)]
    xfailed = [m for m in members if m.report is not None and _is_xfailed(m.report)]
    if xfailed and not by_themselves and any(m.failing for m in members):
        # The expected failure happened; the other ranks were only stopped because of it
        # (stuck in a collective it never reached). That is still the expected failure.
        first = xfailed[0].report
        assert first is not None
        notes = [
            (f"fsdp2 [rank {m.rank}]", _fault_text(m.fault)) for m in members if m.fault is not None
        ]
        return _make_report(
            info, when, "skipped", first.longrepr, members,
            wasxfail=first.wasxfail, extra_sections=notes,
        )  # fmt: skip
    if any(m.failing for m in members):
        return _failure(info, when, members, world_size)
    reports = [(m.rank, m.report) for m in members if m.report is not None]
    skipped = [(rank, r) for rank, r in reports if r.skipped]
    passed = [(rank, r) for rank, r in reports if r.passed]
    if skipped and not passed:
        first = skipped[0][1]
        longrepr = tuple(first.longrepr) if isinstance(first.longrepr, list) else first.longrepr
        all_xfail = all(hasattr(r, "wasxfail") for _, r in skipped)
        return _make_report(
            info, when, "skipped", longrepr, members,
            wasxfail=first.wasxfail if all_xfail else None,
        )  # fmt: skip
    if skipped:
        xfailed_ranks = [rank for rank, r in skipped if hasattr(r, "wasxfail")]
        xpassed_ranks = [rank for rank, r in passed if hasattr(r, "wasxfail")]
        if len(xfailed_ranks) == len(skipped) and len(xpassed_ranks) == len(passed):
            # An expected failure showed on some ranks; the rest passed unexpectedly but not
            # strictly. The test did fail as expected somewhere: report it as XFAIL.
            first = skipped[0][1]
            return _make_report(
                info, when, "skipped", first.longrepr, members, wasxfail=first.wasxfail
            )
        skips = "; ".join(f"rank {rank}: {_skip_reason(r)}" for rank, r in skipped)
        message = (
            f"fsdp2: {ranks_text(rank for rank, _ in skipped)} skipped in {when} while "
            f"{ranks_text(rank for rank, _ in passed)} ran it ({skips}).\n"
            "A pytest.skip inside the ranks counts only when every rank skips: make the "
            "condition the same on all ranks, or use a skip/skipif marker (decided once, in "
            "the pytest process)."
        )
        return _make_report(info, when, "failed", message, members)
    all_xpass = bool(passed) and all(hasattr(r, "wasxfail") for _, r in passed)
    return _make_report(
        info, when, "passed", None, members,
        wasxfail=passed[0][1].wasxfail if all_xpass else None,
    )  # fmt: skip


def _members(outcomes: Sequence[RankOutcome], when: Phase) -> list[_Member]:
    """The ranks that reported ``when`` or were stopped in it."""
    members = [
        _Member(o.rank, o.phase(when), o.fault if o.charged_phase() == when else None)
        for o in outcomes
    ]
    return [m for m in members if m.report is not None or m.fault is not None]


def merge_phase(info: ItemInfo, when: Phase, outcomes: Sequence[RankOutcome]) -> pytest.TestReport:
    """One phase's report from every rank's report of it (ranks that agree after each phase)."""
    return _merge_phase(info, when, _members(outcomes, when), len(outcomes))


def merge(info: ItemInfo, outcomes: Sequence[RankOutcome]) -> list[pytest.TestReport]:
    """The parent's reports for one test from every rank's outcome (see the module rules)."""
    world_size = len(outcomes)
    merged: list[pytest.TestReport] = []
    setup = _members(outcomes, "setup")
    if setup:
        report = _merge_phase(info, "setup", setup, world_size)
        if report.outcome != "passed":
            # The merged test has no call phase when setup fails, yet a rank may have passed
            # its setup and then failed or hung in call: its account belongs to this failure.
            carried = [m for m in _members(outcomes, "call") if m.failing]
            if carried:
                replaced = {m.rank for m in carried}
                kept = [m for m in setup if m.rank not in replaced]
                report = _merge_phase(info, "setup", [*kept, *carried], world_size)
        merged.append(report)
        if report.outcome == "passed" and (call := _members(outcomes, "call")):
            merged.append(_merge_phase(info, "call", call, world_size))
    if teardown := _members(outcomes, "teardown"):
        merged.append(_merge_phase(info, "teardown", teardown, world_size))
    else:
        # Every rank was stopped before teardown; pytest's reporters (junitxml) close a
        # test on its teardown report, so there always is one.
        merged.append(_make_report(info, "teardown", "passed", None, []))
    notes = [(f"fsdp2 notes [rank {o.rank}]", "\n".join(o.notes)) for o in outcomes if o.notes]
    if merged and notes:
        merged[-1].sections = [*merged[-1].sections, *notes]
    return merged


def error_reports(info: ItemInfo, message: str) -> list[pytest.TestReport]:
    """A setup error decided in the pytest process (bad marker, ranks that would not start)."""
    return [
        pytest.TestReport(info.nodeid, info.location, info.keywords, "failed", message, "setup"),
        pytest.TestReport(info.nodeid, info.location, info.keywords, "passed", None, "teardown"),
    ]


def skipped_reports(info: ItemInfo, reason: str) -> list[pytest.TestReport]:
    """A skip decided in the pytest process, located at the test like a skip marker's."""
    longrepr = (info.path, info.lineno, f"Skipped: {reason}")
    return [
        pytest.TestReport(info.nodeid, info.location, info.keywords, "skipped", longrepr, "setup"),
        pytest.TestReport(info.nodeid, info.location, info.keywords, "passed", None, "teardown"),
    ]


def xfail_not_run_reports(info: ItemInfo, reason: str) -> list[pytest.TestReport]:
    """``xfail(run=False)``: reported as pytest does, without starting any rank."""
    setup = pytest.TestReport(
        info.nodeid, info.location, info.keywords, "skipped", f"[NOTRUN] {reason}", "setup"
    )
    setup.wasxfail = f"[NOTRUN] {reason}"
    teardown = pytest.TestReport(
        info.nodeid, info.location, info.keywords, "passed", None, "teardown"
    )
    return [setup, teardown]
