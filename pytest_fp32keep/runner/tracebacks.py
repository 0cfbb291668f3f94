"""Rank tracebacks made readable: library frames hidden, and a key that merges identical ones.

Pure functions over pytest's longrepr objects as they arrive from the ranks (rebuilt from
``pytest_report_to_serializable``): no sockets, no processes. :mod:`.reports` uses them when it
merges the ranks' failures of one test:

- :func:`hide_library_frames` drops the frames of the plugin's own library code that a test
  calls into (``pytest_fp32keep/contract``: ``assert_fp32_keep_contract`` and what it calls).
  They repeat the library's source in every rank and say nothing about the user's bug; the
  exception they raise (a ``ContractViolation``, whose message is the whole verdict) stays, on
  the test's last frame, as pytest shows it for a ``__tracebackhide__`` frame. The runner knows
  that folder by its path only: it imports nothing of it.
- :func:`merge_key` is the text two ranks' accounts are compared by: memory addresses, rank
  numbers inside paths, loopback ports and temporary folders normalised, and the elements of a
  printed set sorted (set order follows hashes, which differ per process: ``--showlocals``
  prints ``{'b', 'a'}`` on one rank and ``{'a', 'b'}`` on the other), so that tracebacks that
  differ only in those merge into one ("ranks 0,1,2").
- :func:`mask_rank_values` replaces the values of the runner's per-rank fixtures (``fsdp2_rank``,
  ``fsdp2_device``) where pytest prints a test's arguments (and its locals, under ``-l``): they
  differ on every rank by design, so without it a test that takes ``fsdp2_rank`` never merges.
- :func:`wrap_error_lines` wraps the ``E`` lines of an exception's message that are wider than
  :data:`ERROR_WIDTH` (a library's error listing one problem per line, each hundreds of columns
  long), continuation lines indented under their line's text; nothing is cut.
- :func:`condense_stacks` shortens faulthandler's dump of a stopped rank to the test's frames:
  the rank session's own threads dropped, each stack cut where pytest's machinery begins.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Final

from _pytest._code.code import (
    ExceptionChainRepr,
    ReprEntry,
    ReprExceptionInfo,
    ReprFuncArgs,
    ReprLocals,
    ReprTraceback,
)

from pytest_fp32keep.runner.waits import WATCH_THREAD_FUNCTION

#: Folders whose frames a failing rank's traceback does not show (the contract's own code).
HIDDEN_FOLDERS: Final[tuple[str, ...]] = (
    str(Path(__file__).resolve().parents[1] / "contract") + os.sep,
)
#: The same folders as a rank may name them relative to its rootdir.
_HIDDEN_RELATIVE: Final = ("pytest_fp32keep/contract/",)

#: The runner's fixtures whose value is each rank's own (:mod:`.fixtures`).
PER_RANK_FIXTURES: Final = frozenset({"fsdp2_rank", "fsdp2_device"})
#: Their line among a frame's locals (``-l``), as pytest pads it: ``name<spaces> = value``.
_PER_RANK_LOCAL: Final = re.compile(rf"^((?:{'|'.join(sorted(PER_RANK_FIXTURES))})\s* = ).*$")
_ADDRESS: Final = re.compile(r"0x[0-9a-fA-F]+")
_PATH: Final = re.compile(r"/[^\s:'\"()]+")
_RANK_IN_PATH: Final = re.compile(r"rank[_-]?\d+")
#: One element of a printed set that can be sorted as text: a string, a name, a number.
_SET_ELEMENT: Final = r"""(?:'[^'\\\n]*'|"[^"\\\n]*"|[\w.+-]+)"""
#: A whole set display of such elements, as ``repr`` prints one (not cut short by saferepr).
_SET_DISPLAY: Final = re.compile(rf"\{{({_SET_ELEMENT}(?:, {_SET_ELEMENT})+)\}}")
_LOOPBACK_PORT: Final = re.compile(
    r"\b(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|\[::1?\]):\d+|\b(port[ =:]+)\d+"
)


def _hidden(path: str) -> bool:
    relative = path.replace(os.sep, "/").removeprefix("./")
    return os.path.abspath(path).startswith(HIDDEN_FOLDERS) or relative.startswith(_HIDDEN_RELATIVE)


def _is_hidden_entry(entry: Any) -> bool:
    location = getattr(entry, "reprfileloc", None)
    return isinstance(entry, ReprEntry) and location is not None and _hidden(location.path)


def _error_lines(entry: ReprEntry) -> list[str]:
    """The ``E   ...`` lines pytest wrote under the raising frame."""
    return [line for line in entry.lines if line.startswith("E   ")]


def _trim(traceback: ReprTraceback) -> ReprTraceback:
    entries = list(traceback.reprentries)
    kept = [entry for entry in entries if not _is_hidden_entry(entry)]
    if len(kept) == len(entries) or not kept or not isinstance(kept[-1], ReprEntry):
        return traceback  # nothing hidden, or nothing of the user's left to show
    last = entries[-1]
    if _is_hidden_entry(last):
        assert isinstance(last, ReprEntry)
        hidden = len(entries) - len(kept)
        note = f"    # ... {hidden} frame{'s' if hidden != 1 else ''} of pytest_fp32keep's contract"
        tail = kept[-1]
        location = tail.reprfileloc
        if location is not None and last.reprfileloc is not None and tail.style == "long":
            location = dataclasses.replace(location, message=last.reprfileloc.message)
        kept[-1] = dataclasses.replace(
            tail,
            lines=[*tail.lines, note, *_error_lines(last)],
            reprfileloc=location,
        )
    return dataclasses.replace(traceback, reprentries=kept)


def hide_library_frames(longrepr: Any) -> Any:
    """``longrepr`` without the frames in :data:`HIDDEN_FOLDERS` (a new object; the input is
    left as it is). Anything that is not pytest's exception repr comes back unchanged, as does a
    traceback made only of such frames (an error inside the library itself)."""
    return _map_tracebacks(longrepr, _trim)


def _map_tracebacks(longrepr: Any, change: Any) -> Any:
    """``longrepr`` with ``change`` applied to each of its ``ReprTraceback`` (a new object; the
    input is left as it is). Anything that is not pytest's exception repr comes back as it is."""
    if isinstance(longrepr, ExceptionChainRepr):
        chain = [(change(tb), crash, descr) for tb, crash, descr in longrepr.chain]
        changed = ExceptionChainRepr(chain)
        changed.sections = list(longrepr.sections)
        return changed
    if isinstance(longrepr, ReprExceptionInfo):
        return dataclasses.replace(longrepr, reprtraceback=change(longrepr.reprtraceback))
    return longrepr


#: The widest an ``E`` line of a rank's failure is printed (a terminal's 100 columns).
ERROR_WIDTH: Final = 100
#: An ``E`` line: the marker, its indentation, the text.
_ERROR_LINE: Final = re.compile(r"^(E\s+)(\s*)(.*)$")


def _wrapped_error_line(line: str, width: int) -> list[str]:
    match = _ERROR_LINE.match(line)
    if len(line) <= width or match is None:
        return [line]
    marker, indent, text = match.groups()
    # Continuations sit 4 columns in from the line's own text; spaces in the text are kept
    # where no break falls (aligned columns of a listing stay aligned on the first line).
    wrapped = textwrap.wrap(
        text,
        width - len(marker),
        initial_indent=indent,
        subsequent_indent=indent + "    ",
        break_on_hyphens=False,
        break_long_words=False,
        drop_whitespace=True,
    )
    return [marker + piece for piece in wrapped] if wrapped else [line]


def _wrap_entry(entry: Any, width: int) -> Any:
    if not isinstance(entry, ReprEntry) or not any(len(line) > width for line in entry.lines):
        return entry
    lines = [
        piece
        for line in entry.lines
        for piece in (_wrapped_error_line(line, width) if line.startswith("E") else [line])
    ]
    return dataclasses.replace(entry, lines=lines)


def wrap_error_lines(longrepr: Any, width: int = ERROR_WIDTH) -> Any:
    """``longrepr`` with each ``E`` line wider than ``width`` wrapped at spaces (a new object;
    the input is left as it is): its continuation lines start with ``E``, the line's
    indentation and four more spaces. A word longer than the room is left whole."""

    def wrap(traceback: ReprTraceback) -> ReprTraceback:
        entries = [_wrap_entry(entry, width) for entry in traceback.reprentries]
        return dataclasses.replace(traceback, reprentries=entries)

    return _map_tracebacks(longrepr, wrap)


def _mask_entry(entry: Any, shown: str) -> Any:
    if not isinstance(entry, ReprEntry):
        return entry
    funcargs, local_vars = entry.reprfuncargs, entry.reprlocals
    if funcargs is not None:
        args = [(n, shown if n in PER_RANK_FIXTURES else v) for n, v in funcargs.args]
        funcargs = ReprFuncArgs(args)
    if local_vars is not None:
        lines = [
            _PER_RANK_LOCAL.sub(lambda m: m.group(1) + shown, line) for line in local_vars.lines
        ]
        local_vars = ReprLocals(lines)
    return dataclasses.replace(entry, reprfuncargs=funcargs, reprlocals=local_vars)


def mask_rank_values(longrepr: Any, shown: str) -> Any:
    """``longrepr`` with the printed value of every :data:`PER_RANK_FIXTURES` argument (and
    local) replaced by ``shown`` (a new object; the input is left as it is)."""

    def mask(traceback: ReprTraceback) -> ReprTraceback:
        entries = [_mask_entry(entry, shown) for entry in traceback.reprentries]
        return dataclasses.replace(traceback, reprentries=entries)

    return _map_tracebacks(longrepr, mask)


def _sorted_set(match: re.Match[str]) -> str:
    return "{" + ", ".join(sorted(re.findall(_SET_ELEMENT, match.group(1)))) + "}"


def merge_key(text: str) -> str:
    """``text`` with what differs between ranks of one identical failure normalised: memory
    addresses, rank numbers inside paths (``/run/rank1/``), loopback ports and the temporary
    folder's contents (``/tmp/pytest-of-u/pytest-7/...``)."""
    text = _ADDRESS.sub("0x?", text)
    text = _SET_DISPLAY.sub(_sorted_set, text)
    temporary = re.escape(tempfile.gettempdir().rstrip("/"))
    text = re.sub(temporary + r"/[^\s:'\"()]*", "<tmp>", text)
    text = _PATH.sub(lambda match: _RANK_IN_PATH.sub("rank?", match.group(0)), text)
    return _LOOPBACK_PORT.sub(
        lambda match: f"{match.group(1)}:?" if match.group(1) else f"{match.group(2)}?", text
    )


#: Frames from these files are pytest's and the rank session's machinery, not the test's.
_MACHINERY: Final = (
    "/_pytest/",
    "/pluggy/",
    "pytest_fp32keep/runner/rank_session.py",
    "<frozen runpy>",
)


def _is_runner_thread(frame: str) -> bool:
    """Whether a frame line belongs to one of the threads the rank session starts itself."""
    line = frame.rstrip()
    return ("rank_session.py" in line and line.endswith(" in watch")) or (
        "runner/waits.py" in line and line.endswith(f" in {WATCH_THREAD_FUNCTION}")
    )


def condense_stacks(text: str) -> str:
    """faulthandler's dump without the noise: the rank's own watchdog thread is dropped, and
    each thread's stack stops where pytest's machinery begins (the test is above it)."""
    blocks: list[str] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if not lines:
            continue
        # Thread ids differ between ranks; without them identical stacks merge.
        header, frames = re.sub(r" 0x[0-9a-f]+", "", lines[0]), lines[1:]
        if any(_is_runner_thread(frame) for frame in frames):
            continue  # the rank's own watchdog and watch threads: always there, never interesting
        kept: list[str] = []
        for frame in frames:
            if kept and any(marker in frame for marker in _MACHINERY):
                kept.append(
                    f"  ... {len(frames) - len(kept)} frames of pytest and the rank session"
                )
                break
            kept.append(frame)
        blocks.append("\n".join([header, *kept]))
    return "\n\n".join(blocks)
