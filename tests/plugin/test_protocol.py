"""The wire between the controller and its ranks, checked without processes: framing, passed
reports coalesced with the next message (issue 24: the controller wakes once per segment, so a
passing test wakes it once per rank, not four times), and spilling long texts."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
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


needs_cork = pytest.mark.skipif(
    not hasattr(socket, "TCP_CORK"), reason="coalescing uses Linux's TCP_CORK"
)


@pytest.fixture
def tcp_pair() -> Iterator[tuple[protocol.Channel, protocol.Channel]]:
    """Two ends of a loopback TCP connection, as between the controller and a rank."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    sender, receiver = protocol.Channel(ours), protocol.Channel(theirs)
    yield sender, receiver
    sender.close()
    receiver.close()


def _readable(channel: protocol.Channel, timeout: float) -> bool:
    return bool(select.select([channel.sock], [], [], timeout)[0])


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


@needs_cork
def test_a_coalesced_message_waits_for_the_next_and_both_arrive_together(
    tcp_pair: tuple[protocol.Channel, protocol.Channel],
) -> None:
    sender, receiver = tcp_pair
    setup, call = protocol.report(NODEID, {"when": "setup"}), protocol.report(NODEID, {})
    sender.send(setup, coalesce=True)
    sender.send(call, coalesce=True)
    assert not _readable(receiver, 0.05)
    done = protocol.done(NODEID, [])
    sender.send(done)
    assert _readable(receiver, 5)
    assert receiver.read_available() == [setup, call, done]


class _CountingSocket:
    """A socket whose ``setsockopt`` calls are counted (a real socket's cannot be patched)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.calls = sock, 0

    def setsockopt(self, *args: Any) -> None:
        self.calls += 1
        self.sock.setsockopt(*args)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)


def test_a_socket_that_refuses_to_cork_is_asked_once_not_for_every_message() -> None:
    # A socketpair is no TCP socket: setsockopt(TCP_CORK) raises. Each coalesced message asked
    # it again before; the refusal is now remembered, and every frame goes at once.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        counting = _CountingSocket(ours)
        channel = protocol.Channel(counting)  # type: ignore[arg-type]
        at_start = counting.calls  # TCP_NODELAY, tried once
        messages = [protocol.report(NODEID, {"when": str(i)}) for i in range(5)]
        for message in messages:
            channel.send(message, coalesce=True)
        channel.send(protocol.done(NODEID, []))
        assert counting.calls - at_start == int(hasattr(socket, "TCP_CORK"))
        received: list[protocol.Message] = []
        decoder = protocol.FrameDecoder()
        while len(received) < len(messages) + 1:
            received += decoder.feed(theirs.recv(65536))
        assert received == [*messages, protocol.done(NODEID, [])]  # nothing held back


@needs_cork
def test_a_coalesced_message_is_not_lost_when_the_sender_goes_away(
    tcp_pair: tuple[protocol.Channel, protocol.Channel],
) -> None:
    sender, receiver = tcp_pair
    setup = protocol.report(NODEID, {"when": "setup"})
    sender.send(setup, coalesce=True)
    sender.close()  # a rank that exits or dies: the kernel closes its socket the same way
    assert _readable(receiver, 5)
    assert receiver.read_available() == [setup]
    with pytest.raises(protocol.ConnectionClosed):
        receiver.read_available()


@needs_cork
def test_a_coalesced_message_goes_out_by_itself_when_nothing_follows(
    tcp_pair: tuple[protocol.Channel, protocol.Channel],
) -> None:
    sender, receiver = tcp_pair
    setup = protocol.report(NODEID, {"when": "setup"})
    sender.send(setup, coalesce=True)  # then the rank hangs in the test's call
    assert _readable(receiver, 2)  # Linux holds corked data for 200 ms at most
    assert receiver.read_available() == [setup]


class _Segments:
    """A TCP socket stand-in: records what leaves as one segment, holding frames while corked."""

    def __init__(self) -> None:
        self.segments: list[list[protocol.Message]] = []
        self._held: list[protocol.Message] = []
        self._corked = False

    def sendall(self, data: bytes) -> None:
        self._held += protocol.FrameDecoder().feed(data)
        if not self._corked:
            self._flush()

    def setsockopt(self, level: int, option: int, value: int) -> None:
        if option == getattr(socket, "TCP_CORK", None):
            self._corked = bool(value)
            if not self._corked:
                self._flush()

    def _flush(self) -> None:
        if self._held:
            self.segments.append(self._held)
            self._held = []


def _serialised(config: Any, report: pytest.TestReport) -> dict[str, Any]:
    return {"when": report.when, "outcome": report.outcome}


def _phase(when: str, outcome: str) -> pytest.TestReport:
    return pytest.TestReport(NODEID, ("test_x.py", 0, "test_y"), {}, outcome, None, when)  # type: ignore[arg-type]


def _run_one_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, teardown: str
) -> list[list[protocol.Message]]:
    """The segments one test sends the controller, for a test whose teardown is ``teardown``."""
    segments = _Segments()
    channel = protocol.Channel(segments)  # type: ignore[arg-type]
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
    return segments.segments


def _kinds(writes: list[list[protocol.Message]]) -> list[list[str]]:
    return [
        [m["report"]["when"] if m["type"] == "report" else m["type"] for m in w] for w in writes
    ]


@needs_cork
def test_a_passing_test_reaches_the_controller_in_one_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segments = _run_one_test(tmp_path, monkeypatch, "passed")
    assert _kinds(segments) == [["setup", "call", "teardown", "done"]]


def test_a_failed_report_is_sent_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    segments = _run_one_test(tmp_path, monkeypatch, "failed")
    cork = hasattr(socket, "TCP_CORK")
    passed = [["setup", "call", "teardown"]] if cork else [["setup"], ["call"], ["teardown"]]
    assert _kinds(segments) == [*passed, ["done"]]


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


RANK_WATCHDOG = """
import socket, sys, time
from pytest_fp32keep.runner.rank_session import _watch_controller
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
_watch_controller(sock)
sock.sendall(b"a report the controller never reads")
time.sleep(60)  # stuck in a collective: only the watchdog can end this rank
"""


def test_a_rank_ends_when_its_controller_dies_with_a_report_unread(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_WATCHDOG)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        rank = subprocess.Popen([sys.executable, str(script), str(listener.getsockname()[1])])
        try:
            controller, _ = listener.accept()
            assert select.select([controller], [], [], 30)[0], "the rank sent nothing"
            controller.close()  # unread data: the kernel resets the connection (no FIN)
            assert rank.wait(timeout=30) == rank_session.EXIT_CONTROLLER_GONE
        finally:
            rank.kill()
            rank.wait()
