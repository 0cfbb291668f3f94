"""Declarations → an immutable keep plan. Pure: reads the model, changes nothing, no collectives."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

import torch
from torch import nn

from fp32keep.errors import KeepDeclarationError, hidden_in_tracebacks
from fp32keep.frozen import FrozenMapping
from fp32keep.plan.compat import (
    LOW_PRECISION_DTYPES,
    REGULAR_ATTR,
    STRICT_ATTR,
    KeepSemantics,
    ListKind,
    installed_semantics,
    semantics_for,
)
from fp32keep.plan.constructed import Construction, constructed_fp32, constructed_matches
from fp32keep.reprs import dataclass_repr
from fp32keep.tensors import (
    TensorSlot,
    check_float_dtype,
    check_module,
    dtype_name,
    is_castable_float,
    join,
    tensor_slots,
)

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

#: Why a tensor is kept: a declaration list, or the model code building it in FP32.
MatchKind = Literal["regular", "strict", "constructed"]


@dataclass(frozen=True)
class KeepMatch:
    """Why one tensor is kept.

    Attributes:
        entry: the declaration entry that matched; for a constructed tensor,
            ``"constructed in torch.float32 by <Class>"`` (the module class that builds it).
        list_kind: ``"regular"`` (``_keep_in_fp32_modules``), ``"strict"``
            (``_keep_in_fp32_modules_strict``) or ``"constructed"`` (in no list, but built in
            FP32 by the model code when ``from_pretrained`` constructs the model at the dtype,
            so it loads FP32; :mod:`fp32keep.plan.constructed`).
        via_alias: for a tied tensor kept because another of its names matched, that name.
    """

    entry: str
    list_kind: MatchKind
    via_alias: str | None = None


@dataclass(frozen=True)
class KeepPlan:
    """Which floating tensors of a model stay in FP32 when it runs in ``dtype``.

    Built by :func:`resolve_keep_plan`; immutable through and through (its collections are
    tuples, frozensets and a :class:`fp32keep.frozen.FrozenMapping`, whatever they were built
    from) and hashable: equal plans hash alike. Every alias of a tied tensor is listed.

    Attributes:
        dtype: the low-precision dtype the plan was resolved for.
        transformers_version: the Transformers release whose semantics were applied.
        semantics_group: ``"A"`` (4.56–4.57), ``"B"`` (5.0.0) or ``"C"`` (5.1 and later).
        regular_entries: entries of ``_keep_in_fp32_modules`` that applied at ``dtype``.
        strict_entries: entries of ``_keep_in_fp32_modules_strict`` that applied at ``dtype``.
        regular_dropped, strict_dropped: entries declared in that list which the release's
            dtype gate drops at ``dtype`` (T5's ``wo`` at bf16 in 4.56-4.57 and 5.1+:
            ``_keep_in_fp32_modules`` applies under fp16 only).
        param_names: FQNs of kept parameters, all aliases.
        buffer_names: FQNs of kept floating buffers, all aliases.
        matches: for every kept FQN, the entry and list that caught it.
        model_name: the class name of the model, for messages.
        declared_by: the prefixes of the modules whose declarations were read (``""``: the
            model itself; ``"pretrained_model"``: a wrapper's Transformers model).
        unobserved: for each Transformers model among them whose construction could not be
            observed (no config, or its rebuild failed), why; its constructed-FP32 tensors are
            then not in the plan.
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
    regular_dropped: tuple[str, ...] = ()
    strict_dropped: tuple[str, ...] = ()
    declared_by: tuple[str, ...] = ("",)
    unobserved: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Immutable through and through, whatever the caller passed (a list, a set, a dict:
        # ``dataclasses.replace(plan, matches={})``): copied, so nothing outside the plan can
        # change it, and hashable, so equal plans hash alike.
        freeze = object.__setattr__
        for name in ("regular_entries", "strict_entries", "declared_by", "unobserved"):
            freeze(self, name, tuple(getattr(self, name)))
        for name in ("param_names", "buffer_names"):
            freeze(self, name, frozenset(getattr(self, name)))
        freeze(self, "matches", FrozenMapping(self.matches))

    def __repr__(self) -> str:
        # Sorted: the same plan must print the same on every rank (fp32keep.reprs).
        return dataclass_repr(self)

    @property
    def names(self) -> frozenset[str]:
        """Every kept FQN, parameters and buffers."""
        return self.param_names | self.buffer_names

    @property
    def is_empty(self) -> bool:
        """True when nothing is kept."""
        return not self.matches

    def digest(self) -> str:
        """A hash of the dtype and of every kept name with its list kind: what ranks compare,
        equal wherever two plans keep the same tensors under the same lists. Which entry is
        credited with a match is left out: it changes no dtype, only the explanation."""
        rows = sorted((n, m.list_kind) for n, m in self.matches.items())
        return hashlib.sha256(repr((str(self.dtype), rows)).encode()).hexdigest()

    def applies_at(self, list_kind: ListKind) -> frozenset[torch.dtype]:
        """The load dtypes at which the release this plan follows applies a keep list
        (``"regular"``: ``_keep_in_fp32_modules``; ``"strict"``: the strict list)."""
        semantics = semantics_for(self.transformers_version)
        return semantics.regular_dtypes if list_kind == "regular" else semantics.strict_dtypes

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.matches

    def match_for(self, fqn: str) -> KeepMatch | None:
        """The entry and list that caught ``fqn``, or None when it is not kept."""
        return self.matches.get(fqn)

    def describe(self) -> str:
        """A readable table of every kept tensor and the entry that caught it."""
        header = (
            f"Keep plan for {self.model_name} at {dtype_name(self.dtype)} "
            f"(Transformers {self.transformers_version}, group {self.semantics_group}): "
            f"{len(self.param_names)} parameter name(s), {len(self.buffer_names)} buffer "
            "name(s) kept in FP32"
        )
        lines = [header]
        if self.declared_by not in ((), ("",)):
            lines.append(f"  declarations read from: {list(self.declared_by)}")
        lines.append(f"  regular entries applied: {list(self.regular_entries)}")
        lines.append(f"  strict entries applied:  {list(self.strict_entries)}")
        lines.extend(f"  construction not observed: {note}" for note in self.unobserved)
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


def _installed_group() -> str | None:
    # Without Transformers installed no post_init ran: the class-level reading is the truth.
    try:
        return installed_semantics().group
    except metadata.PackageNotFoundError:
        return None


def _declares(module: nn.Module) -> bool:
    # Declared on the class (any base, PreTrainedModel's ``None`` included) or set on the instance;
    # attribute forwarding (PEFT's ``__getattr__``) does not count: the forwarded lists belong to
    # the wrapped model, and are read there, under its own names.
    attributes = (REGULAR_ATTR, STRICT_ATTR)
    if any(attribute in vars(module) for attribute in attributes):
        return True
    return any(
        attribute in vars(klass) for klass in type(module).__mro__ for attribute in attributes
    )


def _declaring_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The topmost modules that carry keep declarations, with their prefixes.

    ``model`` itself when it declares (a Transformers model, or any module with the attributes);
    otherwise the topmost declaring submodules of a wrapper (a value-head model, a critic, PEFT's
    ``PeftModel``), each resolved under its own names as ``from_pretrained`` would resolve it.
    """
    if _declares(model):
        return [("", model)]
    roots: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = join(prefix, name)
            if _declares(child):
                roots.append((fqn, child))
            else:
                visit(fqn, child)

    visit("", model)
    return roots or [("", model)]


def _class_level(module: nn.Module, attribute: str) -> Any:
    """The declaration as the class wrote it (via the MRO), not what a ``post_init`` rewrote."""
    for klass in type(module).__mro__:
        if attribute in vars(klass):
            return vars(klass)[attribute]
    return None


def _is_transformers_model(module: nn.Module) -> bool:
    # Only PreTrainedModels run post_init; checked by name so that the plan never imports
    # Transformers.
    return any(klass.__name__ == "PreTrainedModel" for klass in type(module).__mro__)


def _post_init_lists(module: nn.Module, attribute: str) -> list[str]:
    """What 5.1+'s ``post_init`` leaves in ``attribute``, rebuilt from class-level declarations.

    Its own class list, then every direct child's runtime value: a PreTrainedModel child's own
    ``post_init`` result (recursively), a plain module's class attribute when it has one. A plain
    module between two models therefore breaks the chain, as it does in Transformers.
    """
    entries = _class_entries(module, attribute)
    for child in module.children():
        if _is_transformers_model(child):
            entries += _post_init_lists(child, attribute)
        else:
            entries += _class_entries(child, attribute)
    return list(dict.fromkeys(entries))


def _class_entries(module: nn.Module, attribute: str) -> list[str]:
    value = _class_level(module, attribute)
    if isinstance(value, str):
        raise KeepDeclarationError(
            f"{type(module).__name__}.{attribute}: a keep-in-fp32 declaration is the string "
            f"{value!r}; declare a list of module names instead, e.g. [{value!r}]"
        )
    return [str(entry) for entry in (value or ())]


def _declared_entries(
    model: nn.Module, semantics: KeepSemantics, *, runtime: bool
) -> Iterator[tuple[ListKind, tuple[str, ...]]]:
    # With the installed release's semantics (runtime=True) the top model's runtime attributes
    # are what `from_pretrained` reads: in 5.1+ `post_init` has already folded nested models'
    # lists into them (as sets), in 4.x it has not. Another release's rules (the what-if) must
    # start from the class-level declarations instead and redo that release's post_init: 5.10's
    # sets would otherwise be ignored by 5.0.0's lists-only rule (T5 would keep nothing).
    # 5.0.0 loads with the `dtype_plan` frozen at __init__, when the model has one.
    dtype_plan = getattr(model, "dtype_plan", None)
    if semantics.reads_dtype_plan and isinstance(dtype_plan, dict):
        strict_declared = (
            getattr(model, STRICT_ATTR, None) if runtime else _class_level(model, STRICT_ATTR)
        )
        strict = strict_declared or ()
        planned = [str(entry) for entry, dtype in dtype_plan.items() if dtype == torch.float32]
        yield "regular", tuple(e for e in planned if e not in strict)
        yield "strict", tuple(e for e in planned if e in strict)
        return
    for kind, attribute in (("regular", REGULAR_ATTR), ("strict", STRICT_ATTR)):
        value: object
        if runtime:
            value = getattr(model, attribute, None)
        elif semantics.group == "C" and _is_transformers_model(model):
            value = _post_init_lists(model, attribute)
        else:
            value = _class_level(model, attribute)
        try:
            entries = semantics.declared(value)
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

    Applies one Transformers version's own rules (dtype gates, match rule, entry validation,
    nested declarations, tuple/set declarations; see :mod:`fp32keep.plan.compat`) to the
    ``_keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict`` declarations.

    Where the declarations are read:

    * ``model`` itself when it carries them (a Transformers model, or any ``nn.Module`` with the
      attributes on its class or instance);
    * otherwise, for a wrapper (a value-head model, a critic, PEFT's ``PeftModel``), the topmost
      declaring submodules: each one's entries are matched against the names *under* it, as
      ``from_pretrained`` matched them when it loaded that model, and the plan lists the full
      names under the wrapper. A wrapper's own attribute names never match an entry.

    With the installed release's rules (``transformers_version`` omitted, or a release of the
    same behaviour group) the runtime attributes are read, which is what that ``from_pretrained``
    reads. With another group's rules (the what-if) the class-level declarations are read through
    the MRO and that release's ``post_init`` is replayed (5.1+: children's lists folded in), so
    what the installed ``post_init`` rewrote (5.1+ turns lists into sets, which 5.0.0 ignores)
    does not leak into the answer. An instance-level declaration is then not read.

    Args:
        model: the model, on any device (meta included). It is not modified.
        dtype: the low-precision dtype in play: the storage dtype when it is fp16/bf16, otherwise
            the mixed-precision ``param_dtype`` (so FP32 master weights under a bf16 policy still
            honour the strict list). ``torch.float32`` keeps nothing.
        transformers_version: resolve as this Transformers release would (for example to see
            what an upgrade changes); default: the installed release.

    Tensors in no list are kept too when the model code builds them in FP32: each Transformers
    model the declarations are read from is rebuilt from its config on the meta device, under
    ``dtype`` as the installed ``from_pretrained`` builds it, and every floating parameter or
    persistent buffer that comes out FP32 is kept (``list_kind="constructed"``), since loading
    leaves it FP32 (:mod:`fp32keep.plan.constructed`; cached per class, config and dtype). A model
    without a config, or whose rebuild fails, adds nothing and says so in ``unobserved``.

    Only floating tensors are kept (integer buffers are never touched, unlike 5.x loading, which
    casts matched integer buffers to fp32). A tied tensor is kept when any of its names matches,
    and the plan then lists every name.

    Raises:
        KeepDeclarationError: a declaration Transformers itself would refuse.
        TypeError / ValueError: ``dtype`` is not a floating torch dtype.
    """
    check_module(model, where="resolve_keep_plan")
    check_float_dtype(dtype, what="dtype")
    if transformers_version is None:
        semantics, runtime = installed_semantics(), True
    else:
        semantics = semantics_for(transformers_version)
        runtime = semantics.group == _installed_group()
    regular: list[str] = []
    strict: list[str] = []
    dropped: dict[ListKind, list[str]] = {"regular": [], "strict": []}
    scopes: list[_Scope] = []
    roots = _declaring_roots(model)
    for prefix, root in roots:
        root_regular: list[str] = []
        root_strict: list[str] = []
        for kind, entries in _declared_entries(root, semantics, runtime=runtime):
            if semantics.validates_entries:
                _validate_segments(root, kind, entries)
            if semantics.applies(kind, dtype):
                (root_regular if kind == "regular" else root_strict).extend(entries)
            else:
                dropped[kind].extend(entries)
        # 5.x builds a dict keyed by entry (regular first), so a duplicate keeps its first place.
        ordered: dict[str, ListKind] = dict.fromkeys(root_regular, "regular")
        for entry in root_strict:
            ordered.setdefault(entry, "strict")
        if ordered:
            scopes.append(_Scope.build(prefix, ordered, semantics, type(root).__name__))
        regular += root_regular
        strict += root_strict
    slots = tensor_slots(model)
    matches = _match(slots, scopes)
    observed = _observe_constructions(roots, dtype, semantics)
    for name, (entry, via) in constructed_matches(slots, observed, matches).items():
        matches[name] = KeepMatch(entry, "constructed", via_alias=via)
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
        matches=matches,
        model_name=type(model).__name__,
        regular_dropped=tuple(dict.fromkeys(dropped["regular"])),
        strict_dropped=tuple(dict.fromkeys(dropped["strict"])),
        declared_by=tuple(prefix for prefix, _ in roots),
        unobserved=tuple(c.note for _, c in observed if c.note),
    )


def _observe_constructions(
    roots: list[tuple[str, nn.Module]], dtype: torch.dtype, semantics: KeepSemantics
) -> list[tuple[str, Construction]]:
    # Only a Transformers model is built by from_pretrained; at FP32 (or wider) nothing differs.
    # The rebuild runs the installed class code, also for another release's rules (what-if).
    if dtype not in LOW_PRECISION_DTYPES or not semantics.keeps_constructed_fp32:
        return []
    return [
        (prefix, constructed_fp32(root, dtype))
        for prefix, root in roots
        if _is_transformers_model(root)
    ]


@dataclass(frozen=True)
class _Scope:
    """One declaring module's compiled entries, matched against the names under ``prefix``."""

    prefix: str
    ordered: dict[str, ListKind]
    alternation: re.Pattern[str]
    per_entry: dict[str, re.Pattern[str]]

    @classmethod
    def build(
        cls, prefix: str, ordered: dict[str, ListKind], semantics: KeepSemantics, owner: str
    ) -> _Scope:
        return cls(
            prefix,
            ordered,
            semantics.compile(list(ordered), owner=owner),
            {entry: semantics.compile([entry], owner=owner) for entry in ordered},
        )

    def relative(self, name: str) -> str | None:
        """``name`` as the declaring module sees it, or None when it lies outside it."""
        if not self.prefix:
            return name
        return name.removeprefix(self.prefix + ".") if name.startswith(self.prefix + ".") else None


def _match(slots: list[TensorSlot], scopes: list[_Scope]) -> dict[str, KeepMatch]:
    if not scopes:
        return {}
    matches: dict[str, KeepMatch] = {}
    for slot in slots:
        if not is_castable_float(slot.tensor.dtype):
            continue
        direct: dict[str, KeepMatch] = {}
        for name in slot.names:
            for scope in scopes:
                relative = scope.relative(name)
                # The alternation decides, exactly as Transformers searches it; the per-entry
                # patterns only say which entry to credit.
                if relative is None or scope.alternation.search(relative) is None:
                    continue
                entry = next(
                    (e for e, p in scope.per_entry.items() if p.search(relative)),
                    "|".join(scope.ordered),
                )
                direct[name] = KeepMatch(entry, scope.ordered.get(entry, "regular"))
                break
        if not direct:
            continue
        first_name, first_match = next(iter(direct.items()))
        for name in slot.names:
            matches[name] = direct.get(name) or KeepMatch(
                first_match.entry, first_match.list_kind, via_alias=first_name
            )
    return matches
