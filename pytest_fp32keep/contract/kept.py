"""What the contract says about the tensors it keeps: one row each, a note when there are none,
and the caller's floor on how many (``expect_kept``).

A contract that keeps nothing passes every row vacuously: nothing is kept, so nothing can be
stored or gathered wrong. That happens when the dtype gate of the installed Transformers drops a
declaration (T5 declares ``_keep_in_fp32_modules = ["wo"]``, which 4.56-4.57 and 5.1+ apply under
fp16 only, so at bf16 nothing is kept), and a green test then proves nothing about FP32. The
report says so in a note naming the declared lists and the rule that dropped them, read from the
keep plan (:attr:`fp32keep.KeepPlan.regular_dropped`, :attr:`~fp32keep.KeepPlan.strict_dropped`)
and the release's own gates (:meth:`fp32keep.KeepPlan.applies_at`), never re-derived here.
``expect_kept=N`` turns it into a failure: a ``kept count`` row fails when fewer than N tensors
are kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

import fp32keep
from fp32keep import KeepPlan
from pytest_fp32keep.contract.probe import dtype_name
from pytest_fp32keep.contract.report import Finding, KeptTensor

__all__ = [
    "NOTHING_KEPT",
    "check_kept_count",
    "kept_rows",
    "nothing_kept_note",
    "validate_expect_kept",
]

REGULAR_ATTR, STRICT_ATTR = "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"

#: How the note of a contract that keeps nothing begins (``fp32keep check`` picks it out).
NOTHING_KEPT = "nothing is kept in FP32 at "


def validate_expect_kept(expect_kept: object) -> int | None:
    """``expect_kept`` as given (``None`` or a whole number, 0 or more); anything else is a
    ``ValueError`` naming it, raised before anything is built."""
    if expect_kept is None:
        return None
    if isinstance(expect_kept, bool) or not isinstance(expect_kept, int) or expect_kept < 0:
        raise ValueError(
            f"assert_fp32_keep_contract(expect_kept={expect_kept!r}): expected None or a whole "
            "number of tensors (0 or more) that the run must keep in FP32, e.g. expect_kept=4 "
            "for the two `wo` weights of each of T5's two layers under fp16"
        )
    return expect_kept


def kept_rows(
    plan: KeepPlan, findings: Sequence[Finding], seen: Mapping[str, str]
) -> tuple[KeptTensor, ...]:
    """One row per kept tensor: its plan entry, and its stored and all-gathered dtypes."""
    return tuple(
        KeptTensor(
            fqn=name,
            entry=(plan.match_for(name) or fp32keep.KeepMatch("?", "regular")).entry,
            list_kind=(plan.match_for(name) or fp32keep.KeepMatch("?", "regular")).list_kind,
            stored=next(
                (f.observed for f in findings if f.check == "stored" and f.subject == name), "-"
            ),
            materialized=seen.get(name, "-"),
        )
        for name in sorted(plan.names)
    )


def _gate(dtypes: frozenset[torch.dtype]) -> str:
    names = sorted(dtype_name(dtype) for dtype in dtypes)
    return f"only under {' or '.join(names)}" if names else "at no dtype"


def nothing_kept_note(plan: KeepPlan) -> str | None:
    """The note for a plan that keeps nothing (``None`` when it keeps something): which lists
    were declared and the release's rule that dropped them at the plan's dtype, or that nothing
    was declared or matched."""
    if not plan.is_empty:
        return None
    at = dtype_name(plan.dtype)
    gates = {REGULAR_ATTR: plan.applies_at("regular"), STRICT_ATTR: plan.applies_at("strict")}
    lists = ((REGULAR_ATTR, plan.regular_dropped), (STRICT_ATTR, plan.strict_dropped))
    dropped = [
        f"{attribute} {list(entries)}, which Transformers {plan.transformers_version} applies "
        f"{_gate(gates[attribute])}"
        for attribute, entries in lists
        if entries
    ]
    applied = [*plan.regular_entries, *plan.strict_entries]
    if dropped:
        why = f"{plan.model_name} declares {'; and '.join(dropped)} (test at such a dtype)"
    elif applied:
        why = f"the entries {applied} apply at {at} but match no floating tensor"
    else:
        why = (
            f"{plan.model_name} declares no {REGULAR_ATTR} or {STRICT_ATTR} entry and builds no "
            "tensor in FP32"
        )
    return (
        f"{NOTHING_KEPT}{at}: {why}; no row checked an FP32 tensor. Pass "
        "expect_kept=N to fail a run that keeps fewer than N tensors"
    )


def check_kept_count(plan: KeepPlan, expect_kept: int | None) -> list[Finding]:
    """The ``kept count`` row: at least ``expect_kept`` tensor names kept (none without it)."""
    if expect_kept is None:
        return []
    kept = len(plan.names)
    return [
        Finding(
            check="kept count",
            subject=f"tensors kept in FP32 at {dtype_name(plan.dtype)}",
            expected=f"at least {expect_kept} (expect_kept={expect_kept})",
            observed=f"{kept}" if kept else "0 (nothing kept: see the note)",
            ok=kept >= expect_kept,
        )
    ]
