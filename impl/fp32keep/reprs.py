"""Reprs that read the same in every process: the elements of sets sorted.

A set's order follows its elements' hashes, and those differ between processes: string hashing
is randomised per interpreter, and a ``torch.dtype`` hashes by its address. The ranks of one
job then print the same plan differently, and pytest's tracebacks (``--showlocals``) of one
identical failure no longer read the same on every rank, so the plugin cannot merge them. The
dataclasses whose fields hold sets use :func:`dataclass_repr`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fp32keep.errors import hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


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
