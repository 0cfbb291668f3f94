"""What a zoo entry is: how to build a model, how to feed it, what to expect from it.

What to expect is written down independently of the plan under test: per Transformers release
line and dtype, the FQN patterns of the tensors Transformers keeps in FP32 and whether
``fp32keep.apply_fsdp2`` must refuse the layout (:class:`KeepExpectation`), from the facts in
``docs/transformers-keep-semantics.md``, not from :func:`fp32keep.resolve_keep_plan`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

if TYPE_CHECKING:
    from fp32keep import KeepLayoutError


@dataclasses.dataclass(frozen=True)
class KeepExpectation:
    """What Transformers keeps of one zoo model in one range of releases, under some dtypes.

    Written from the semantics of each release line (dtype gates, match rule, nested lists), so
    that the plan under test can be checked against it, never the other way round.

    Attributes:
        versions: the Transformers releases this row describes, a PEP 440 specifier set
            (``">=4.56,<4.58"``; pre-releases of a covered release count).
        dtypes: the low-precision dtypes under which these releases keep ``kept``; under any
            other fp16/bf16 dtype they keep nothing and nothing is refused.
        kept: regular expressions, each matching (``re.fullmatch``) the FQNs of some kept
            tensors; together they match exactly the kept floating tensors. ``None`` where the
            names were not verified against a wheel of these releases (only ``refusal`` is).
        refusal: the ``KeepLayoutError`` reason tag ``apply_fsdp2`` must refuse the layout
            with under ``dtypes`` (``"root-owned"``, ``"mixed-unit"``), or ``None``: no refusal.
        refused: regular expressions (``re.fullmatch``) of the tensors the refusal names: each
            refused FQN matches one and each matches a refused FQN. ``None``: those of ``kept``
            (every kept tensor is refused, Rwkv's ``time_decay``); unchecked when both are
            ``None`` (the refusal's tag still is).
        why: for a refusal, one line from the modeling code: the module class that owns the
            kept parameters and the non-kept ones beside them, read in the same forward.
    """

    versions: str
    dtypes: tuple[torch.dtype, ...]
    kept: tuple[str, ...] | None
    refusal: str | None = None
    refused: tuple[str, ...] | None = None
    why: str = ""

    def covers(self, version: str) -> bool:
        """Whether the Transformers release ``version`` is one of this row's."""
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.versions).contains(version, prereleases=True)

    def matches(self, fqn: str) -> bool:
        """Whether ``fqn`` is one of the names this row says are kept."""
        return any(re.fullmatch(pattern, fqn) for pattern in self.kept or ())

    def refusal_mismatch(self, tags: frozenset[str], fqns: tuple[str, ...]) -> str | None:
        """How a ``KeepLayoutError`` with reason ``tags`` naming ``fqns`` differs from this row's
        refusal (:attr:`refusal`, :attr:`refused`), or ``None`` where it is the one written."""
        if self.refusal is None:
            return "no refusal is written for this dtype"
        if tags != {self.refusal}:
            return f"written [{self.refusal}], refused [{', '.join(sorted(tags))}]"
        patterns = self.refused if self.refused is not None else self.kept
        if patterns is None:
            return None
        unwritten = [fqn for fqn in fqns if not any(re.fullmatch(p, fqn) for p in patterns)]
        unmatched = [p for p in patterns if not any(re.fullmatch(p, fqn) for fqn in fqns)]
        if not unwritten and not unmatched:
            return None
        parts = []
        if unwritten:
            parts.append(f"refused {', '.join(unwritten)}, which no written pattern matches")
        if unmatched:
            parts.append(f"written pattern(s) {', '.join(unmatched)} match no refused tensor")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One zoo model: how to build it, how to feed it, and what to expect from it.

    Attributes:
        name: Registry key, lower case (``"t5"``, ``"gpt_oss"``, ...).
        model_class: Name of the Transformers class ``build`` instantiates; the entry is
            unavailable when the installed Transformers does not export it.
        build: Returns a fresh FP32 model built from a tiny config with :data:`BUILD_SEED`
            (same weights on every call). Imports ``transformers`` lazily.
        make_batch: ``make_batch(model, seed)`` returns the keyword arguments of one
            forward pass (always with ``labels``, so the output carries a loss) on the
            model's device; ``seed`` is an ``int`` or a ``torch.Generator``. The same seed
            gives the same batch.
        dtypes: The low-precision dtypes under which the model's declarations keep
            something in a 5.1+ ``from_pretrained`` (regular list: fp16; strict list:
            fp16 and bf16). What the *installed* version keeps is the plan's business:
            5.0.0 applies the regular list under bf16 too, and a class may declare
            nothing in older versions (see ``notes``).
        expect_layout_error: ``True`` when FSDP2 cannot isolate the kept tensors as
            units of their own, so ``fp32keep.apply_fsdp2`` must raise
            ``KeepLayoutError`` naming them wherever something is kept; which dtypes that is
            per release is in ``expectations``.
        expectations: what each release line keeps and refuses (:class:`KeepExpectation`),
            written independently of the plan; :meth:`refused_under` reads it.
        min_transformers: Lowest Transformers version the entry is meant for, or
            ``None``; below it the entry is reported unavailable.
        notes: Why the entry is in the zoo, in one or two sentences.
        written_in: where ``expectations`` are written, as a check's report names it.
    """

    name: str
    model_class: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module, int | torch.Generator], dict[str, torch.Tensor]]
    dtypes: tuple[torch.dtype, ...]
    expect_layout_error: bool = False
    expectations: tuple[KeepExpectation, ...] = ()
    min_transformers: str | None = None
    notes: str = ""
    written_in: str = "the zoo (pytest_fp32keep/check/zoo/models.py)"

    def expectation(self, dtype: torch.dtype, version: str | None = None) -> KeepExpectation | None:
        """The row of ``expectations`` for ``dtype`` in Transformers ``version`` (default: the
        installed one): the row covering the release whose ``dtypes`` hold ``dtype``; ``None``
        where a covered release keeps nothing under ``dtype`` or no row covers the release."""
        version = version or transformers_version()
        return next(
            (row for row in self.expectations if row.covers(version) and dtype in row.dtypes),
            None,
        )

    def covers(self, version: str | None = None) -> bool:
        """Whether ``expectations`` describe Transformers ``version`` (default: installed)."""
        version = version or transformers_version()
        return any(row.covers(version) for row in self.expectations)

    def refused_under(self, version: str | None = None) -> frozenset[torch.dtype]:
        """The dtypes under which ``apply_fsdp2`` must refuse this model in Transformers
        ``version`` (default: installed), from ``expectations`` alone; for a release no row
        covers, every dtype of ``dtypes`` (the 5.1+ gates) when ``expect_layout_error``."""
        version = version or transformers_version()
        if not self.covers(version):
            return frozenset(self.dtypes) if self.expect_layout_error else frozenset()
        return frozenset(
            dtype
            for row in self.expectations
            if row.covers(version) and row.refusal is not None
            for dtype in row.dtypes
        )

    def refusal_mismatch(
        self, dtype: torch.dtype, error: KeepLayoutError, version: str | None = None
    ) -> str | None:
        """How ``error`` differs from the refusal written for ``dtype`` in Transformers
        ``version`` (default: installed), or ``None`` where it is the one written: its reason
        tags and refused FQNs (:meth:`KeepExpectation.refusal_mismatch`). For a release no row
        covers (refused by ``expect_layout_error`` alone), any row's refusal will do."""
        version = version or transformers_version()
        tags = frozenset(problem.reason for problem in error.problems)
        if self.covers(version):
            row = self.expectation(dtype, version)
            written = [row] if row is not None and row.refusal is not None else []
            if not written:
                return f"no refusal is written for {dtype} in transformers {version}"
        else:
            written = [row for row in self.expectations if row.refusal is not None]
            if not written:  # expected by expect_layout_error alone: nothing to compare with
                return None
        mismatches = [row.refusal_mismatch(tags, error.fqns) for row in written]
        if any(mismatch is None for mismatch in mismatches):
            return None
        return f"not the refusal written in {self.written_in}: {'; '.join(map(str, mismatches))}"

    def unavailable_reason(self) -> str | None:
        """Why the installed Transformers cannot build this entry, or ``None`` if it can."""
        from packaging.version import Version

        installed = transformers_version()
        if self.min_transformers is not None and Version(installed) < Version(
            self.min_transformers
        ):
            return (
                f"{self.model_class} needs transformers>={self.min_transformers}; "
                f"installed {installed}"
            )
        transformers = importlib.import_module("transformers")
        try:
            getattr(transformers, self.model_class)
        except AttributeError:
            return f"transformers {installed} has no {self.model_class}"
        except ImportError as exc:  # the class exists but needs a missing dependency
            return f"transformers {installed} cannot import {self.model_class}: {exc}"
        return None


class ZooAvailability(NamedTuple):
    """What the installed Transformers can build.

    Attributes:
        available: Entries that build, in registry order.
        unavailable: Entry name → reason, for the entries that do not.
    """

    available: Mapping[str, ZooEntry]
    unavailable: Mapping[str, str]


def transformers_version() -> str:
    """The installed Transformers version string (read from metadata, no import)."""
    return importlib.metadata.version("transformers")
