"""Reading back the violation's table from its message: the cells of each row, unwrapped.

The table fits 100 columns, so a long cell continues on the next lines of its row
(``pytest_fp32keep/contract/report.py``); a check that looks for a whole cell reads it here.
"""

from __future__ import annotations

import re

COLUMNS = ("check", "subject", "expected", "observed")


def table_rows(message: str) -> list[dict[str, str]]:
    """Each row of the first table in ``message`` (pytest's ``E`` prefixes allowed), as
    ``{column: whole cell}``, the lines of a wrapped cell joined by a space (exact where it
    wrapped at a space; a cell broken inside a name reads with a space there)."""
    lines = message.splitlines()
    at = next(i for i, line in enumerate(lines) if re.search(r"\bcheck\s+subject\s", line))
    starts = [lines[at].index(column) for column in COLUMNS]
    left = starts[0]
    rows: list[dict[str, list[str]]] = []
    for line in lines[at + 1 :]:
        status = re.search(r"\s(FAIL|ok)$", line)
        if status is not None and not line[:left].strip("E "):
            rows.append({column: [] for column in COLUMNS})  # a row's first line
            line = line[: status.start()]
        elif not (rows and line[: starts[1]].strip("E ") == "" and line[starts[1] :].strip()):
            break  # the table ended
        for k, column in enumerate(COLUMNS):
            end = starts[k + 1] if k + 1 < len(COLUMNS) else None
            if piece := line[starts[k] : end].strip():
                rows[-1][column].append(piece)
    return [{column: " ".join(pieces) for column, pieces in row.items()} for row in rows]
