"""The wire between the controller and its ranks, checked without processes: framing, several
frames in one write, and which of a rank's messages share a write (issue 24: the controller wakes
once per write, so a passing test costs it one wake-up less per rank)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_fp32keep.runner import protocol, rank_session
from pytest_fp32keep.runner.rank_context import RankContext
from pytest_fp32keep.runner.spill import MAX_CHARS, spill_report
from pytest_fp32keep.runner.waits import CommunicationWatch

NODEID = "test_x.py::test_y"


@pytest.fixture
def pair() -> Iterator[tuple[protocol.Channel, protocol.Channel]]:
    ours, theirs = socket.socketpair()
    sender, receiver = protocol.Channel(ours), protocol.Channel(theirs)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_frames_split_anywhere_are_decoded_whole_and_in_order() -> None:
    messages = [protocol.run(NODEID, None, 7), protocol.done(NODEID, ["a note"]), {"type": "x"}]
    stream = b"".join(protocol.encode(m) for m in messages)
    for cut in range(len(stream) + 1):
        decoder = protocol.FrameDecoder()
        assert decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) == messages


def test_a_frame_that_is_no_message_is_refused_and_the_next_one_still_decodes() -> None:
    decoder = protocol.FrameDecoder()
    with pytest.raises(protocol.ProtocolError, match="not a message"):
        decoder.feed(protocol.encode([1, 2]) + protocol.encode({"type": "exit"})[:3])  # type: ignore[arg-type]
    assert decoder.feed(protocol.encode({"type": "exit"})[3:]) == [{"type": "exit"}]


def test_send_many_is_one_write_the_peer_reads_at_once(
    pair: tuple[protocol.Channel, protocol.Channel],
) -> None:
    sender, receiver = pair
    messages = [protocol.report(NODEID, {"when": "teardown"}), protocol.done(NODEID, [])]
    sender.send_many(messages)
    assert receiver.read_available() == messages


class _Writes:
    """A socket stand-in that records each ``sendall`` as one write."""

    def __init__(self) -> None:
        self.writes: list[list[protocol.Message]] = []

    def sendall(self, data: bytes) -> None:
        self.writes.append(protocol.FrameDecoder().feed(data))

    def setsockopt(self, *args: object) -> None:
        pass


def _serialised(config: Any, report: pytest.TestReport) -> dict[str, Any]:
    return {"when": report.when, "outcome": report.outcome}


def _phase(when: str, outcome: str) -> pytest.TestReport:
    return pytest.TestReport(NODEID, ("test_x.py", 0, "test_y"), {}, outcome, None, when)  # type: ignore[arg-type]


def _run_one_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, teardown: str
) -> list[list[protocol.Message]]:
    """What one test's writes to the controller are, for a test whose teardown is ``teardown``."""
    writes = _Writes()
    channel = protocol.Channel(writes)  # type: ignore[arg-type]
    watch = CommunicationWatch(channel, observes=False)
    plugin = rank_session.RankSessionPlugin(channel, RankContext(0, 0, 2, "gloo"), tmp_path, watch)
    plugin._config = SimpleNamespace(  # type: ignore[assignment]
        hook=SimpleNamespace(pytest_report_to_serializable=_serialised)
    )
    monkeypatch.setattr(rank_session, "process_group_problem", lambda: None)

    def protocol_of_pytest(item: Any, nextitem: Any) -> None:
        for when, outcome in (("setup", "passed"), ("call", "passed"), ("teardown", teardown)):
            plugin.pytest_runtest_logreport(_phase(when, outcome))

    item = SimpleNamespace(
        config=SimpleNamespace(hook=SimpleNamespace(pytest_runtest_protocol=protocol_of_pytest))
    )
    session = SimpleNamespace(_setupstate=None)
    plugin._run(session, {NODEID: item}, protocol.run(NODEID, None, 1))  # type: ignore[arg-type,dict-item]
    return writes.writes


def _kinds(writes: list[list[protocol.Message]]) -> list[list[str]]:
    return [
        [m["report"]["when"] if m["type"] == "report" else m["type"] for m in w] for w in writes
    ]


def test_a_passed_teardown_report_goes_in_the_same_write_as_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _run_one_test(tmp_path, monkeypatch, "passed")
    assert _kinds(writes) == [["setup"], ["call"], ["teardown", "done"]]


def test_a_failed_teardown_report_is_sent_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _run_one_test(tmp_path, monkeypatch, "failed")
    assert _kinds(writes) == [["setup"], ["call"], ["teardown"], ["done"]]


def test_only_long_sections_are_spilled(tmp_path: Path) -> None:
    report = _phase("call", "passed")
    long = "x" * (MAX_CHARS + 1)
    report.sections = [("Captured stdout call", "short"), ("Captured stderr call", long)]
    spill_report(report, tmp_path)
    assert report.sections[0] == ("Captured stdout call", "short")
    title, kept = report.sections[1]
    assert title == "Captured stderr call" and "characters cut here" in kept
    (spilled,) = tmp_path.iterdir()
    assert spilled.name == "test_x.py_test_y-call-section1.txt"
    assert spilled.read_text() == long
