"""The docs stand on their own: nothing refers outside the repository, and the README stays short.

- No tracked file names a path outside the repository: the project's notes folder beside the
  checkout (a parent-relative ``shared`` path, or its ``docs``/``seeds`` folders) is in neither
  the repository nor the distributions, and a relative Markdown link may not climb out of the
  repository either.
- Each row of the README's API table (``| function | what it does |``) is one short line, at
  most :data:`MAX_ROW` characters; the details live in docs/api.md.

Each check is a function of text, run on the real files and, as a negative control, on a crafted
bad text that it must reject.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_ROW = 400
"""The longest a row of the README's API table may be, in characters."""

API_TABLE_HEADER = "| function | what it does |"

# Spelled in pieces so that this file does not match itself.
_SHARED = "sha" + "red"
OUTSIDE_PATH = re.compile(rf"\.\./+{_SHARED}\b|\b{_SHARED}/(?:docs|seeds)/")
"""A path into the notes folder beside the checkout, which the repository does not hold."""

MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")

#: Folders that are never sources: virtual environments, build output, caches.
NOT_TRACKED = frozenset({".git", ".venv", "build", "dist", "__pycache__", ".nox", ".tox"})


def tracked_files() -> list[Path]:
    """The repository's files: ``git ls-files`` in a checkout, else every file (an sdist)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return [
            path
            for path in ROOT.rglob("*")
            if path.is_file() and not NOT_TRACKED.intersection(path.relative_to(ROOT).parts)
        ]
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _texts() -> Iterator[tuple[str, str]]:
    for path in tracked_files():
        try:
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: names no path a reader follows


def outside_references(where: str, text: str) -> list[str]:
    """Every place in ``text`` (the file ``where``) that refers to a file outside the repository."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"{where}:{number}: {m.group(0)!r}" for m in OUTSIDE_PATH.finditer(line)]
        if where.endswith(".md"):
            for target in MARKDOWN_LINK.findall(line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                resolved = ((ROOT / where).parent / target).resolve()
                if not resolved.is_relative_to(ROOT):
                    found.append(f"{where}:{number}: link {target!r} leaves the repository")
    return found


def api_table_rows(readme: str) -> list[str]:
    """The body rows of the README's API table."""
    lines = readme.splitlines()
    start = lines.index(API_TABLE_HEADER)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def long_rows(readme: str) -> list[str]:
    """Each API-table row over :data:`MAX_ROW` characters, as ``function: length``."""
    return [
        f"{row.split('|')[1].strip()}: {len(row)} characters"
        for row in api_table_rows(readme)
        if len(row) > MAX_ROW
    ]


def test_nothing_refers_to_files_outside_the_repository() -> None:
    files = dict(_texts())
    assert "README.md" in files and "impl/fp32keep/plan/compat.py" in files, sorted(files)[:5]
    found = [hit for where, text in files.items() for hit in outside_references(where, text)]
    assert found == [], "files outside the repository are referenced:\n" + "\n".join(found)


def test_an_outside_reference_is_caught() -> None:
    crafted = {
        "impl/fp32keep/plan/compat.py": f"Every fact mirrors ``{_SHARED}/docs/semantics.md``.",
        "docs/design.md": f"See [the notes](../../{_SHARED}/design.md) and ../{_SHARED}/seeds/x.",
        "docs/a.md": "A link [out](../../elsewhere.md) of the repository.",
    }
    for where, text in crafted.items():
        assert outside_references(where, text), where
    # and what stays inside is fine: links within the repository, a URL, a name like shared.weight
    fine = "[api](api.md#x), [ci](../ci/matrix.toml), [pt](https://pytorch.org/x), shared.weight"
    assert outside_references("docs/b.md", fine) == []


def test_readme_api_table_rows_are_short() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = api_table_rows(readme)
    assert len(rows) >= 6, rows  # every public function of the library has its row
    assert long_rows(readme) == [], f"rows over {MAX_ROW} characters: move details to docs/api.md"


def test_a_long_api_row_is_caught() -> None:
    readme = (ROOT / "README.md").read_text()
    row = api_table_rows(readme)[0]
    padded = row[:-1] + "x" * (MAX_ROW - len(row) + 1) + "|"
    assert long_rows(readme.replace(row, padded)) == [
        f"{row.split('|')[1].strip()}: {MAX_ROW + 1} characters"
    ]
