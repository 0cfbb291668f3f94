"""What differs between Transformers versions, in one place.

Every fact here is stated, in prose and in two tables, in ``docs/transformers-keep-semantics.md``
(read from the released wheels of 4.56.2 … 5.24.0; releases read since are in
``docs/transformers-versions.md``); ``tests/core/test_semantics_doc.py`` compares those tables
with :func:`semantics_for`. A reader checking the resolver against a Transformers release only has
to diff this file against that page:

* group A (4.56.x – 4.57.x): the regular list applies under fp16, the strict list under fp16 or
  bf16; an entry matches whole dot-separated segments (``((^|\\.)ENTRY($|\\.))``, the entry not
  escaped); ``post_init`` rejects entries that are not one non-numeric segment of a parameter name.
* group B (5.0.0): both lists apply at every dtype; an entry is a glob (``*`` → ``.*``) searched
  anywhere in the name; only ``list`` declarations count (a tuple or set is silently ignored);
  loading reads ``model.dtype_plan``, frozen in ``PreTrainedModel.__init__``, so entries a
  subclass appends later (InstructBlip appends its language model's ``wo``) are not applied.
* group C (5.1.0 and later; checked up to 5.25.0): the dtype gates of group A with the glob
  match of group B; tuples and sets count; ``post_init`` folds nested models' lists into the top
  model's runtime attributes.

In every group ``from_pretrained`` builds the model under the load dtype and loads each tensor into
the dtype it was built with, so a parameter or persistent buffer the model code builds with an
explicit ``dtype=torch.float32`` stays FP32 though no list names it (measured on 4.56.2, 5.0.0,
5.10.4 and 5.24.0; :mod:`fp32keep.plan.constructed` observes it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from typing import Literal

import torch
from packaging.version import Version

from fp32keep.errors import KeepDeclarationError, hidden_in_tracebacks
from fp32keep.reprs import dataclass_repr

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

Group = Literal["A", "B", "C"]
ListKind = Literal["regular", "strict"]

REGULAR_ATTR = "_keep_in_fp32_modules"
STRICT_ATTR = "_keep_in_fp32_modules_strict"
LOW_PRECISION_DTYPES = frozenset({torch.float16, torch.bfloat16})

# The first release of each behaviour group; versions below 4.56 are not supported by the
# distribution (pyproject pins transformers>=4.56) and would resolve as group A.
_GROUP_B_FIRST = Version("5.0.0")
_GROUP_C_FIRST = Version("5.1.0")


@dataclass(frozen=True)
class KeepSemantics:
    """How one Transformers release decides which tensors stay in FP32.

    Attributes:
        group: the behaviour group ("A", "B" or "C") of the semantics document.
        version: the Transformers version these semantics were chosen for.
        regular_dtypes: load dtypes under which ``_keep_in_fp32_modules`` applies.
        strict_dtypes: load dtypes under which ``_keep_in_fp32_modules_strict`` applies.
        lists_only: only ``list`` declarations count (5.0.0 ignores tuples and sets).
        validates_entries: entries must name one whole parameter-name segment (4.x ``post_init``).
        reads_dtype_plan: a model's ``dtype_plan`` dict, when it has one, is what loading applies
            (5.0.0), rather than the runtime lists.
        keeps_constructed_fp32: tensors the model code builds in FP32 under a low-precision
            default dtype stay FP32 through ``from_pretrained`` (every release measured, 4.56.2
            to 5.24.0; a release that casts them would set it False).
    """

    group: Group
    version: str
    regular_dtypes: frozenset[torch.dtype]
    strict_dtypes: frozenset[torch.dtype]
    lists_only: bool
    validates_entries: bool
    reads_dtype_plan: bool = False
    keeps_constructed_fp32: bool = True

    def __repr__(self) -> str:
        # Sorted: dtypes hash by address, so set order differs between ranks (fp32keep.reprs).
        return dataclass_repr(self)

    @property
    def match_rule(self) -> str:
        """One line saying how an entry is matched against a tensor name."""
        if self.group == "A":
            return "whole dot-segments: ((^|\\.)ENTRY($|\\.))"
        return "glob searched anywhere in the name: '*' -> '.*'"

    def applies(self, kind: ListKind, dtype: torch.dtype) -> bool:
        """Whether the list of ``kind`` is honoured when the model runs in ``dtype``."""
        gate = self.regular_dtypes if kind == "regular" else self.strict_dtypes
        return dtype in gate

    def declared(self, value: object) -> tuple[str, ...] | None:
        """The entries a runtime declaration contributes, or None when it is ignored."""
        if value is None:
            return None
        if self.lists_only and not isinstance(value, list):
            return None
        if isinstance(value, str):
            # A bare string is iterable; Transformers would treat it as characters. Refuse it.
            raise KeepDeclarationError(
                f"a keep-in-fp32 declaration is the string {value!r}; declare a list of "
                f"module names instead, e.g. [{value!r}]"
            )
        if not isinstance(value, Iterable):
            raise KeepDeclarationError(
                f"a keep-in-fp32 declaration must be a list of module names, got "
                f"{type(value).__name__}: {value!r}"
            )
        if isinstance(value, Set):
            # 5.1+'s post_init folds the lists into sets: their order follows string hashing,
            # which differs between processes, and the first matching entry is the one credited.
            return tuple(sorted(str(entry) for entry in value))
        return tuple(str(entry) for entry in value)

    def entry_pattern(self, entry: str) -> str:
        """The regular-expression source Transformers builds for one entry."""
        if self.group == "A":
            return rf"((^|\.){entry}($|\.))"
        return entry.replace("*", ".*")

    def compile(self, entries: Sequence[str], *, owner: str) -> re.Pattern[str]:
        """The single alternation Transformers searches every tensor name with."""
        try:
            return re.compile("|".join(self.entry_pattern(entry) for entry in entries))
        except re.error as error:
            raise KeepDeclarationError(
                f"{owner}: the keep-in-fp32 entries {list(entries)!r} do not form a valid "
                f"pattern under Transformers {self.version} ({self.match_rule}): {error}. "
                "Fix the entry (escape regex characters such as '(' or '[')."
            ) from error


def semantics_for(version: str | Version) -> KeepSemantics:
    """The keep semantics of a given Transformers version."""
    parsed = Version(str(version)) if not isinstance(version, Version) else version
    # Pre-releases of 5.0 (5.0.0rc*) already carried the 5.x loader; compare on the release.
    release = Version(parsed.base_version)
    fp16 = frozenset({torch.float16})
    if release >= _GROUP_C_FIRST:
        return KeepSemantics("C", str(parsed), fp16, LOW_PRECISION_DTYPES, False, False)
    if release >= _GROUP_B_FIRST:
        return KeepSemantics(
            "B", str(parsed), LOW_PRECISION_DTYPES, LOW_PRECISION_DTYPES, True, False, True
        )
    return KeepSemantics("A", str(parsed), fp16, LOW_PRECISION_DTYPES, False, True)


@lru_cache(maxsize=1)
def installed_transformers_version() -> str:
    """The installed Transformers version, read from package metadata without importing it."""
    return metadata.version("transformers")


def installed_semantics() -> KeepSemantics:
    """The keep semantics of the installed Transformers."""
    return semantics_for(installed_transformers_version())
