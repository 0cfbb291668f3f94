"""Declarations → an immutable keep plan. Pure: reads the model, changes nothing, no collectives."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from fp32keep.compat import (
    REGULAR_ATTR,
    STRICT_ATTR,
    KeepSemantics,
    ListKind,
    installed_semantics,
    semantics_for,
)
from fp32keep.errors import KeepDeclarationError
from fp32keep.tensors import TensorSlot, check_float_dtype, is_castable_float, tensor_slots


@dataclass(frozen=True)
class KeepMatch:
    """Why one tensor is kept.

    Attributes:
        entry: the declaration entry that matched.
        list_kind: ``"regular"`` (``_keep_in_fp32_modules``) or ``"strict"``
            (``_keep_in_fp32_modules_strict``).
        via_alias: for a tied tensor kept because another of its names matched, that name.
    """

    entry: str
    list_kind: ListKind
    via_alias: str | None = None


@dataclass(frozen=True)
class KeepPlan:
    """Which floating tensors of a model stay in FP32 when it runs in ``dtype``.

    Built by :func:`resolve_keep_plan`; immutable. Every alias of a tied tensor is listed.

    Attributes:
        dtype: the low-precision dtype the plan was resolved for.
        transformers_version: the Transformers release whose semantics were applied.
        semantics_group: ``"A"`` (4.56–4.57), ``"B"`` (5.0.0) or ``"C"`` (5.1 and later).
        regular_entries: entries of ``_keep_in_fp32_modules`` that applied at ``dtype``.
        strict_entries: entries of ``_keep_in_fp32_modules_strict`` that applied at ``dtype``.
        param_names: FQNs of kept parameters, all aliases.
        buffer_names: FQNs of kept floating buffers, all aliases.
        matches: for every kept FQN, the entry and list that caught it.
        model_name: the class name of the model, for messages.
    """

    dtype: torch.dtype
    transformers_version: str
    semantics_group: str
    regular_entries: tuple[str, ...]
    strict_entries: tuple[str, ...]
    param_names: frozenset[str]
    buffer_names: frozenset[str]
    matches: Mapping[str, KeepMatch] = field(repr=False)
    model_name: str = "model"

    @property
    def names(self) -> frozenset[str]:
        """Every kept FQN, parameters and buffers."""
        return self.param_names | self.buffer_names

    @property
    def is_empty(self) -> bool:
        """True when nothing is kept."""
        return not self.matches

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.matches

    def match_for(self, fqn: str) -> KeepMatch | None:
        """The entry and list that caught ``fqn``, or None when it is not kept."""
        return self.matches.get(fqn)

    def describe(self) -> str:
        """A readable table of every kept tensor and the entry that caught it."""
        header = (
            f"Keep plan for {self.model_name} at {_dtype_name(self.dtype)} "
            f"(Transformers {self.transformers_version}, group {self.semantics_group}): "
            f"{len(self.param_names)} parameter name(s), {len(self.buffer_names)} buffer "
            "name(s) kept in FP32"
        )
        lines = [header]
        lines.append(f"  regular entries applied: {list(self.regular_entries)}")
        lines.append(f"  strict entries applied:  {list(self.strict_entries)}")
        if self.is_empty:
            lines.append("  (nothing kept)")
            return "\n".join(lines)
        rows = [("tensor", "kind", "list", "entry")]
        for fqn in sorted(self.matches):
            match = self.matches[fqn]
            kind = "param" if fqn in self.param_names else "buffer"
            entry = (
                match.entry if match.via_alias is None else f"{match.entry} (via {match.via_alias})"
            )
            rows.append((fqn, kind, match.list_kind, entry))
        widths = [max(len(row[column]) for row in rows) for column in range(3)]
        for row in rows:
            lines.append(
                "  "
                + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
                + "  "
                + row[3]
            )
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _declared_entries(
    model: nn.Module, semantics: KeepSemantics
) -> Iterator[tuple[ListKind, tuple[str, ...]]]:
    # The top model's runtime attributes are what `from_pretrained` reads in every version; in
    # 5.1+ `post_init` has already folded nested models' lists into them, in 4.x it has not.
    # 5.0.0 loads with the `dtype_plan` frozen at __init__ instead, when the model has one.
    dtype_plan = getattr(model, "dtype_plan", None)
    if semantics.reads_dtype_plan and isinstance(dtype_plan, dict):
        strict = getattr(model, STRICT_ATTR, None) or ()
        planned = [str(entry) for entry, dtype in dtype_plan.items() if dtype == torch.float32]
        yield "regular", tuple(e for e in planned if e not in strict)
        yield "strict", tuple(e for e in planned if e in strict)
        return
    for kind, attribute in (("regular", REGULAR_ATTR), ("strict", STRICT_ATTR)):
        try:
            entries = semantics.declared(getattr(model, attribute, None))
        except KeepDeclarationError as error:
            raise KeepDeclarationError(f"{type(model).__name__}.{attribute}: {error}") from None
        if entries is not None:
            yield kind, entries  # type: ignore[misc]


def _validate_segments(model: nn.Module, kind: ListKind, entries: tuple[str, ...]) -> None:
    # Transformers 4.56/4.57 `post_init` refuses an entry that is not one whole, non-numeric
    # segment of some parameter name (weight/bias excluded); mirror it for plain modules.
    segments = {
        segment
        for name, _ in model.named_parameters()
        for segment in name.split(".")
        if not segment.isnumeric() and segment not in ("weight", "bias")
    }
    attribute = REGULAR_ATTR if kind == "regular" else STRICT_ATTR
    for entry in entries:
        if entry not in segments:
            raise KeepDeclarationError(
                f"{type(model).__name__}.{attribute} entry {entry!r} is not the name of a module "
                "segment of any parameter; Transformers 4.56/4.57 refuse it when the model is "
                "built. Use one whole module name such as 'wo' (dotted, glob or regex entries "
                "need Transformers >= 5.0)."
            )


def resolve_keep_plan(
    model: nn.Module, dtype: torch.dtype, *, transformers_version: str | None = None
) -> KeepPlan:
    """Decide which floating tensors of ``model`` stay in FP32 when it runs in ``dtype``.

    Applies the installed Transformers version's own rules (dtype gates, match rule, entry
    validation, nested declarations, tuple/set declarations; see :mod:`fp32keep.compat`) to the
    ``_keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict`` attributes of ``model``, which
    may be any ``nn.Module`` carrying them.

    Args:
        model: the model, on any device (meta included). It is not modified.
        dtype: the low-precision dtype in play: the storage dtype when it is fp16/bf16, otherwise
            the mixed-precision ``param_dtype`` (so FP32 master weights under a bf16 policy still
            honour the strict list). ``torch.float32`` keeps nothing.
        transformers_version: resolve as this Transformers release would (for example to see
            what an upgrade changes); default: the installed release.

    Only floating tensors are kept (integer buffers are never touched, unlike 5.x loading, which
    casts matched integer buffers to fp32). A tied tensor is kept when any of its names matches,
    and the plan then lists every name.

    Raises:
        KeepDeclarationError: a declaration Transformers itself would refuse.
        TypeError / ValueError: ``dtype`` is not a floating torch dtype.
    """
    check_float_dtype(dtype, what="dtype")
    semantics = (
        installed_semantics()
        if transformers_version is None
        else semantics_for(transformers_version)
    )
    regular: list[str] = []
    strict: list[str] = []
    for kind, entries in _declared_entries(model, semantics):
        if semantics.validates_entries:
            _validate_segments(model, kind, entries)
        if semantics.applies(kind, dtype):
            (regular if kind == "regular" else strict).extend(entries)
    # 5.x builds a dict keyed by entry (regular first), so a duplicate keeps its first place.
    ordered: dict[str, ListKind] = dict.fromkeys(regular, "regular")
    for entry in strict:
        ordered.setdefault(entry, "strict")
    slots = tensor_slots(model)
    matches = _match(slots, semantics, ordered, owner=type(model).__name__)
    param_names = frozenset(
        n for slot in slots if slot.is_param for n in slot.names if n in matches
    )
    buffer_names = frozenset(
        n for slot in slots if not slot.is_param for n in slot.names if n in matches
    )
    return KeepPlan(
        dtype=dtype,
        transformers_version=semantics.version,
        semantics_group=semantics.group,
        regular_entries=tuple(dict.fromkeys(regular)),
        strict_entries=tuple(dict.fromkeys(strict)),
        param_names=param_names,
        buffer_names=buffer_names,
        matches=MappingProxyType(matches),
        model_name=type(model).__name__,
    )


def _match(
    slots: list[TensorSlot], semantics: KeepSemantics, ordered: dict[str, ListKind], *, owner: str
) -> dict[str, KeepMatch]:
    if not ordered:
        return {}
    alternation = semantics.compile(list(ordered), owner=owner)
    per_entry = {entry: semantics.compile([entry], owner=owner) for entry in ordered}
    matches: dict[str, KeepMatch] = {}
    for slot in slots:
        if not is_castable_float(slot.tensor.dtype):
            continue
        direct: dict[str, KeepMatch] = {}
        for name in slot.names:
            # The alternation decides, exactly as Transformers searches it; the per-entry
            # patterns only say which entry to credit.
            if alternation.search(name) is None:
                continue
            entry = next((e for e, p in per_entry.items() if p.search(name)), "|".join(ordered))
            direct[name] = KeepMatch(entry, ordered.get(entry, "regular"))
        if not direct:
            continue
        first_name, first_match = next(iter(direct.items()))
        for name in slot.names:
            matches[name] = direct.get(name) or KeepMatch(
                first_match.entry, first_match.list_kind, via_alias=first_name
            )
    return matches


def check_plan_fits(model: nn.Module, plan: KeepPlan) -> None:
    """Raise ``ValueError`` when ``plan`` names tensors ``model`` does not have."""
    known = {name for slot in tensor_slots(model) for name in slot.names}
    unknown = sorted(plan.names - known)
    if unknown:
        more = " …" if len(unknown) > 5 else ""
        raise ValueError(
            f"the keep plan names tensors {type(model).__name__} does not have: "
            f"{unknown[:5]}{more}; resolve the plan on this model with "
            "fp32keep.resolve_keep_plan(model, dtype)"
        )
