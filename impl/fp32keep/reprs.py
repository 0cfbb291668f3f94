"""Reprs that read the same in every process (the elements of sets sorted), and that stay short.

A set's order follows its elements' hashes, and those differ between processes: string hashing
is randomised per interpreter, and a ``torch.dtype`` hashes by its address. The ranks of one
job then print the same plan differently, and pytest's tracebacks (``--showlocals``) of one
identical failure no longer read the same on every rank, so the plugin cannot merge them. The
dataclasses whose fields hold sets use :func:`dataclass_repr`.

Messages that name keys, parameters or problems name the first few and count the rest
(:func:`first_few`, :func:`first_lines`): a state dict of 2 M unexpected keys gave a 45 MB
message, which every rank built and sent through the collective that agrees on errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

SHOWN: Final = 5
"""How many keys, names or problems a message names before it counts the rest."""

CLIPPED: Final = 200
"""The longest repr of one named item (a key may be any string, or any object)."""


def stable_repr(value: object) -> str:
    """``repr(value)``, with the elements of a set or frozenset in sorted order."""
    if isinstance(value, set | frozenset):
        if not value:
            return f"{type(value).__name__}()"
        inner = "{" + ", ".join(sorted(stable_repr(item) for item in value)) + "}"
        return inner if type(value) is set else f"{type(value).__name__}({inner})"
    return repr(value)


def dataclass_repr(instance: Any) -> str:
    """The dataclass's own repr (its ``repr=True`` fields, in order) with sets sorted."""
    fields = ", ".join(
        f"{field.name}={stable_repr(getattr(instance, field.name))}"
        for field in dataclasses.fields(instance)
        if field.repr
    )
    return f"{type(instance).__name__}({fields})"


def clipped_repr(value: object, limit: int = CLIPPED) -> str:
    """``repr(value)``, cut to ``limit`` characters (ending in ``...``) when longer."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def and_more(count: int, shown: int = SHOWN) -> str:
    """``" … and N more"`` for ``count`` items of which the first ``shown`` were named."""
    return f" … and {count - shown} more" if count > shown else ""


def first_few(items: Sequence[object], shown: int = SHOWN) -> str:
    """The first ``shown`` items as a list (each repr clipped), then how many more there are:
    ``['a', 'b', 'c', 'd', 'e'] … and 1999995 more``."""
    head = "[" + ", ".join(clipped_repr(item) for item in items[:shown]) + "]"
    return head + and_more(len(items), shown)


def first_lines(lines: Sequence[str], shown: int = SHOWN, indent: str = "  ") -> list[str]:
    """The first ``shown`` lines, then one ``"… and N more"`` line (at ``indent``) if cut."""
    if len(lines) <= shown:
        return list(lines)
    return [*lines[:shown], f"{indent}… and {len(lines) - shown} more"]
