"""Text that fits a terminal: the width to use, wrapped paragraphs and a table with wrapped cells.

Pure functions (``terminal_width`` reads the environment only): every line they return is at
most the width asked for, wherever a word allows it, and carries no trailing spaces.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Sequence

#: The width when neither ``COLUMNS`` nor the terminal says otherwise (stdout is a file or pipe).
DEFAULT_WIDTH = 100
#: Below this, nothing is wrapped any narrower: a line this long is still readable.
MIN_WIDTH = 40

# Where a line may break: after a space; inside a word too long for the line, after a separator
# of a dotted name (``package.module:factory``), a list or a path; failing those, anywhere.
_WORDS = re.compile(r"[^ ]* ?")
_NAME_PARTS = re.compile(r"[^.:_/,]*[.:_/,]?")


def terminal_width(default: int = DEFAULT_WIDTH) -> int:
    """The terminal's width (``COLUMNS`` first), else ``default``; never below ``MIN_WIDTH``."""
    return max(MIN_WIDTH, shutil.get_terminal_size((default, 24)).columns)


def _pieces(text: str, width: int) -> list[str]:
    """``text`` as words (each with its trailing space), a word longer than ``width`` split
    after name separators, and a part still longer cut every ``width`` characters."""
    pieces: list[str] = []
    for word in (w for w in _WORDS.findall(text) if w):
        if len(word.rstrip()) <= width:
            pieces.append(word)
            continue
        for part in (p for p in _NAME_PARTS.findall(word) if p):
            pieces += [part[i : i + width] for i in range(0, len(part), width)]
    return pieces


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken after spaces where the words allow it."""
    width = max(1, width)
    if len(text) <= width:
        return [text]
    lines: list[str] = []
    line = ""
    for piece in _pieces(text, width):
        if line and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = piece.lstrip()
        else:
            line += piece
    if line.strip():
        lines.append(line.rstrip())
    return lines or [""]


def wrap_text(text: str, width: int, *, first: str = "", rest: str = "") -> list[str]:
    """A paragraph in lines of at most ``width``: ``first`` before the first, ``rest`` before
    the others (a hanging indent)."""
    lines: list[str] = []
    prefix = first
    remaining = " ".join(text.split())
    while True:
        room = max(1, width - len(prefix))
        head = wrap_cell(remaining, room)[0] if remaining else ""
        lines.append((prefix + head).rstrip())
        remaining = remaining[len(head) :].lstrip()
        if not remaining:
            return lines
        prefix = rest


def fit_lines(text: str, width: int) -> list[str]:
    """Lines of preformatted text (a traceback, an error message) cut to ``width``, each cut
    continued on the next line under the same indentation plus two spaces."""
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        indent = " " * (len(line) - len(line.lstrip()))
        out.extend(wrap_text(line.lstrip(), width, first=indent, rest=indent + "  "))
    return out


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a text table.

    Attributes:
        header: the column's title (wrapped like a cell when the column is narrowed).
        cells: one cell per row.
        gap: spaces before the column (ignored for the first column).
        min_width: how narrow wrapping may make it; 0: the column is never wrapped.
    """

    header: str
    cells: Sequence[str]
    gap: int = 2
    min_width: int = 0

    @property
    def natural_width(self) -> int:
        """The width that shows every cell on one line."""
        return max([len(self.header), *(len(cell) for cell in self.cells)])


def table_width(columns: Sequence[Column], widths: Sequence[int]) -> int:
    """The width of a table whose columns have ``widths``."""
    return sum(widths) + sum(column.gap for column in columns[1:])


def column_widths(columns: Sequence[Column], width: int) -> list[int]:
    """Natural widths, narrowed (last wrappable column first) until the table fits ``width``
    or no column may narrow further."""
    widths = [column.natural_width for column in columns]
    for index in reversed(range(len(columns))):
        excess = table_width(columns, widths) - width
        if excess <= 0:
            break
        floor = min(columns[index].min_width, widths[index])  # never wider than it needs
        if floor:
            widths[index] = max(floor, widths[index] - excess)
    return widths


def render_table(
    columns: Sequence[Column], width: int, *, below: Sequence[Sequence[str]] = ()
) -> list[str]:
    """The table as lines; ``below[i]``, if given, are lines printed under row ``i``."""
    widths = column_widths(columns, width)
    rows = len(columns[0].cells) if columns else 0
    lines: list[str] = []
    for row in range(-1, rows):  # -1: the header
        cells = [
            wrap_cell(column.header if row < 0 else column.cells[row], w)
            for column, w in zip(columns, widths, strict=True)
        ]
        for depth in range(max(len(cell) for cell in cells)):
            parts = []
            for index, (cell, w) in enumerate(zip(cells, widths, strict=True)):
                gap = " " * columns[index].gap if index else ""
                parts.append(gap + (cell[depth] if depth < len(cell) else "").ljust(w))
            lines.append("".join(parts).rstrip())
        if 0 <= row < len(below):
            lines.extend(below[row])
    return lines
