"""Deciding the FSDP2 unit layout that keeps a plan, and every reason it cannot. Pure.

A *unit* is one ``fully_shard`` call: one or more modules whose parameters are all-gathered
together under one mixed-precision policy. Three kinds exist:

* ``kept``: the topmost modules whose floating parameters are all kept, wrap targets nested inside
  them, and modules that directly own only kept parameters (attention ``sinks``) but have
  children that are not kept (chosen in :mod:`fp32keep.layout.kept`); sharded with
  :func:`fp32keep.shard.apply.kept_unit_policy`, no ``param_dtype``, so FSDP2 all-gathers them
  in their FP32 storage dtype without casting the module's inputs (a
  ``param_dtype=torch.float32`` unit would turn the module's activation boundary FP32: the known
  wrong fix);
* ``standard``: the caller's wrap targets (by default the classes in ``_no_split_modules``), and
  the children of an owner unit, sharded before it;
* ``root``: the model itself, owning whatever no other unit took.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch
from torch import nn

from fp32keep.errors import Fp32KeepValueError, KeepLayoutError, LayoutProblem, hidden_in_tracebacks
from fp32keep.layout.kept import ReadFinder, float_param_names, kept_modules
from fp32keep.layout.problems import (
    degraded_problem,
    mixed_dtype_problem,
    mixed_problem,
    read_problem,
    root_problem,
    tied_problem,
)
from fp32keep.layout.reach import outside_uses
from fp32keep.layout.targets import WrapSpec as WrapSpec  # re-exported: its home before the split
from fp32keep.layout.targets import check_wrap, wrap_predicate
from fp32keep.layout.tied import TieGroup, sharding_order, tie_groups
from fp32keep.layout.units import Layout, Unit, UnitKind
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.shard.gathered import methods_to_gather
from fp32keep.tensors import check_module, dtype_name, is_castable_float, iter_owned, join
from fp32keep.uses.observe import ParameterUse, UnitMembers
from fp32keep.uses.source import DirectRead, find_direct_read

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

KeptGrouping: TypeAlias = bool | Literal["block", "model"]
"""How kept modules are grouped into units: ``False`` (one unit per kept module), ``True`` or
``"block"`` (one unit per standard unit's kept modules), ``"model"`` (one unit for all)."""


def _depth(fqn: str) -> int:
    return fqn.count(".") + 1 if fqn else 0


def _kept_grouping(group_kept: KeptGrouping) -> Literal["module", "block", "model"]:
    """Normalise ``group_kept``; anything else is refused before any work is done."""
    if group_kept is False:
        return "module"
    if group_kept is True or group_kept == "block":
        return "block"
    if group_kept == "model":
        return "model"
    raise Fp32KeepValueError(
        f"group_kept={group_kept!r} is not one of False (a unit per kept module), True or "
        "'block' (a unit per block's kept modules), 'model' (one unit for all kept modules)."
    )


def _first_names(model: nn.Module) -> dict[str, str]:
    """Every name of every module -> the first name ``named_modules`` gives its object.

    FSDP2 places a module by the object, not the name: a module reached under two names
    (Transformers 4.x's T5 passes its ``shared`` embedding to both stacks as ``embed_tokens``) is
    managed by the unit that holds it under either, and ``fully_shard`` of an ancestor on the
    other path skips it (it is already an ``FSDPModule``).
    """
    first: dict[int, str] = {}
    return {
        fqn: first.setdefault(id(module), fqn)
        for fqn, module in model.named_modules(remove_duplicate=False)
    }


def _innermost(unit_of_module: dict[str, int], first_names: dict[str, str], module_fqn: str) -> int:
    """The index of the innermost unit around ``module_fqn``, found on the path of the first name
    of its object (see :func:`_first_names`)."""
    module_fqn = first_names.get(module_fqn, module_fqn)
    parts = module_fqn.split(".") if module_fqn else []
    for cut in range(len(parts), -1, -1):
        prefix = ".".join(parts[:cut])
        found = unit_of_module.get(first_names.get(prefix, prefix))
        if found is not None:
            return found
    raise AssertionError("the root unit covers every module")  # pragma: no cover


def plan_layout(
    model: nn.Module,
    plan: KeepPlan,
    *,
    wrap: WrapSpec | None = None,
    group_kept: KeptGrouping = False,
    replicate_frozen: bool = True,
    observed: ParameterUse | None = None,
) -> Layout:
    """Decide the units that keep ``plan`` under FSDP2, or raise with every reason it cannot.

    Kept units are chosen by :func:`fp32keep.layout.kept.kept_modules`: topmost fully kept
    modules, wrap targets nested inside them (never grouped), and owners of only kept, trainable
    parameters with children that are not kept (never grouped; their children become standard
    units). A kept module an ancestor reads without calling it is never a unit: frozen, it is
    replicated; trainable, it goes with its reader or is refused (``read-not-called``). Who
    reads what, and which methods other than ``forward`` run each unit
    (``Layout.forward_methods``), is taken from ``observed`` when given, else from the source
    (:mod:`fp32keep.uses.source`); with ``observed``, a kept parameter used while no module of its
    unit runs is refused too (``read-not-called``), and so, observed or from the source, is any
    parameter of a unit fp32keep makes that code outside the unit uses
    (:mod:`fp32keep.layout.reach`).

    Args:
        model: the unsharded model, already cast (kept tensors FP32).
        plan: the keep plan.
        wrap: standard targets: module classes, class names, or a predicate; default: the
            classes named by the model's ``_no_split_modules``.
        group_kept: ``False``: one unit per kept module. ``True`` or ``"block"``: the kept
            modules that share one standard unit form one unit (one all-gather per block instead
            of one per kept module). ``"model"``: every kept module of the model forms one unit
            that stays all-gathered from the first kept forward to the end of backward (one
            all-gather and one reduce-scatter per step in all, at the price of holding every
            kept parameter unsharded, in FP32, during the step).
        replicate_frozen: a kept parameter that is frozen (``requires_grad=False``) but whose
            module also owns low-precision parameters (a router's correction bias, say) is left
            out of FSDP2 and replicated in FP32 instead of refused; so is a frozen kept module
            read without a call. Trainable ones are refused: FSDP2 would not reduce their
            gradients.
        observed: what a forward of the unsharded model used, and where
            (:func:`fp32keep.observe_parameter_use`); ``None``: read from the source.

    Raises:
        KeepLayoutError: naming every offending parameter and the reason.
    """
    check_module(model, where="plan_layout")
    check_wrap(wrap)
    draft = _draft(model, plan, wrap, group_kept, replicate_frozen, observed)
    if draft.problems:  # checked here, so a refusal's traceback shows this short frame only
        raise KeepLayoutError(draft.problems, model_name=type(model).__name__)
    ordered = sharding_order(draft.units)
    methods = methods_to_gather(model, draft.members, observed)
    return Layout(tuple(ordered), draft.owner, tuple(draft.replicated), methods)


@dataclass(frozen=True)
class _Draft:
    """The units :func:`plan_layout` would shard, who owns each parameter, and what is wrong."""

    units: list[Unit]
    owner: dict[str, str]
    replicated: list[str]
    members: list[UnitMembers]
    problems: list[LayoutProblem]


def _draft(
    model: nn.Module,
    plan: KeepPlan,
    wrap: WrapSpec | None,
    group_kept: KeptGrouping,
    replicate_frozen: bool,
    observed: ParameterUse | None,
) -> _Draft:
    grouping = _kept_grouping(group_kept)
    below = float_param_names(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    first_names = _first_names(model)
    is_target = wrap_predicate(model, wrap)
    find_read = observed.direct_read if observed is not None else find_direct_read
    selection = kept_modules(model, plan, below, is_target, find_read)
    kept = selection.top
    inside_kept = tuple(kept)

    def under_kept(fqn: str) -> bool:
        return any(fqn == k or fqn.startswith(k + ".") or k == "" for k in inside_kept)

    taken = set(selection.owners) | set(selection.owner_children)
    standard = [
        fqn
        for fqn, module in modules.items()
        if fqn and not under_kept(fqn) and fqn not in taken and is_target(module)
    ]

    def build(ties: Sequence[TieGroup]) -> tuple[list[Unit], dict[str, int]]:
        """The units, each module's unit index; a module of a tie group is in that group only."""
        grouped = {fqn for _, fqns in ties for fqn in fqns}
        units: list[Unit] = []
        unit_of_module: dict[str, int] = {}

        def add(kind: UnitKind, fqns: Sequence[str], stays_gathered: bool = False) -> None:
            for fqn in fqns:
                unit_of_module[fqn] = len(units)
            depth = max(_depth(fqn) for fqn in fqns)
            units.append(Unit(kind, tuple(fqns), depth, stays_gathered))

        for fqn in standard + selection.owner_children:
            if fqn not in grouped:
                add("standard", [fqn])
        if "" in selection.owners:  # the root owns only kept parameters: an FP32 unit, last
            add("kept", [""])
        elif "" not in kept:
            add("root", [""])
        top = [fqn for fqn in kept if fqn not in grouped]
        if grouping == "block":
            groups: dict[int, list[str]] = defaultdict(list)
            for fqn in top:
                groups[_innermost(unit_of_module, first_names, fqn)].append(fqn)
            for fqns in groups.values():
                add("kept", fqns)
        elif grouping == "model" and top and top != [""]:
            add("kept", top, stays_gathered=True)
        else:
            for fqn in top:
                add("kept", [fqn])
        # Never grouped: an owner is sharded after its children's units, a nested unit before the
        # kept unit around it; a group spanning depths would claim their parameters first.
        for fqn in selection.owners + selection.nested:
            if fqn and fqn not in grouped:
                add("kept", [fqn])
        # A tie group's modules run at different times (the embedding first, the head last), so
        # it stays gathered in between anyway; not resharding after forward also lets torch
        # releases that wait for every module of a group finish one whose modules did not all run.
        for kind, members in ties:
            add(kind, members, stays_gathered=True)
        return units, unit_of_module

    units, unit_of_module = build(())
    ties = tie_groups(
        model,
        plan,
        {fqn: (unit.kind, unit.module_fqns) for unit in units for fqn in unit.module_fqns},
        lambda module_fqn: _innermost(unit_of_module, first_names, module_fqn),
        below,
    )
    if ties:
        units, unit_of_module = build(ties)

    owner, replicated, problems = _assign_and_validate(
        model,
        plan,
        units,
        lambda module_fqn: _innermost(unit_of_module, first_names, module_fqn),
        replicate_frozen=replicate_frozen,
        read_directly=selection.read_directly,
        reader_obstacles=selection.reader_obstacles,
        find_read=find_read,
        root_obstacle=selection.root_obstacle,
    )
    managed: dict[str, list[str]] = defaultdict(list)
    for name, label in owner.items():
        managed[label].append(name)
    members = [UnitMembers(unit.module_fqns, managed[unit.label]) for unit in units]
    refused = {problem.fqn for problem in problems}
    problems += outside_uses(
        model, plan, units, members, standard, selection.owners, observed, refused
    )
    return _Draft(units, owner, replicated, members, problems)


def _read_covering(reads: Sequence[DirectRead], module_fqn: str) -> DirectRead | None:
    for read in reads:
        if module_fqn == read.module_fqn or module_fqn.startswith(read.module_fqn + "."):
            return read
    return None


@dataclass
class _Owned:
    """One floating parameter (all its aliases): where it lives and which units would hold it."""

    tensor: nn.Parameter
    names: list[str]
    module_fqn: str
    units: set[int] = field(default_factory=set)
    kept: bool = False  # the plan keeps one of its names

    @property
    def first(self) -> str:
        return self.names[0]


@dataclass
class _Assignment:
    """Which unit owns each parameter: ``owner`` by name, ``assigned`` in the model's order (with
    the unit's index), the frozen kept ones left out of FSDP2, the ones several units claim."""

    owner: dict[str, str] = field(default_factory=dict)
    assigned: list[tuple[_Owned, int]] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    claimed_twice: list[_Owned] = field(default_factory=list)


def _inventory(
    model: nn.Module, plan: KeepPlan, innermost: Callable[[str], int]
) -> tuple[list[_Owned], dict[str, list[str]]]:
    """Every floating parameter once, in the model's order, with the units around each alias;
    and what each module owns directly that the plan does not keep (the truth a mixed-unit
    refusal must state)."""
    owned: dict[int, _Owned] = {}
    not_kept_owned: dict[str, list[str]] = defaultdict(list)
    for module_fqn, _, attribute, tensor, is_param in iter_owned(model):
        if not is_param or not is_castable_float(tensor.dtype):
            continue
        name = join(module_fqn, attribute)
        parameter: nn.Parameter = tensor  # type: ignore[assignment]
        record = owned.setdefault(id(tensor), _Owned(parameter, [], module_fqn))
        record.names.append(name)
        record.units.add(innermost(module_fqn))
        record.kept = record.kept or name in plan.param_names
        if name not in plan.param_names:
            not_kept_owned[module_fqn].append(f"{attribute} ({dtype_name(tensor.dtype)})")
    return list(owned.values()), not_kept_owned


def _assign(
    owned: Sequence[_Owned], units: Sequence[Unit], *, replicate_frozen: bool
) -> _Assignment:
    """Give each parameter its one unit; a kept, frozen FP32 one outside a kept unit is
    replicated instead where torch can leave it out of FSDP2."""
    done = _Assignment()
    for record in owned:
        if len(record.units) > 1:
            done.claimed_twice.append(record)
            continue
        index = next(iter(record.units))
        frozen_fp32 = not record.tensor.requires_grad and record.tensor.dtype == torch.float32
        if record.kept and units[index].kind != "kept" and frozen_fp32 and replicate_frozen:
            done.owner.update(dict.fromkeys(record.names, "<replicated>"))
            done.replicated.append(record.first)
            continue
        done.owner.update(dict.fromkeys(record.names, units[index].label))
        done.assigned.append((record, index))
    return done


@dataclass(frozen=True)
class _KeptContext:
    """What judging a kept parameter's unit needs beside the parameter."""

    model: nn.Module
    plan: KeepPlan
    replicate_frozen: bool
    read_directly: Sequence[DirectRead]
    reader_obstacles: Mapping[str, str]
    find_read: ReadFinder
    root_obstacle: str | None
    not_kept_owned: dict[str, list[str]]


def _kept_problems(record: _Owned, unit: Unit, context: _KeptContext) -> list[LayoutProblem]:
    """Why the unit a kept parameter landed in cannot keep it FP32 (empty: it can): stored
    below FP32, read by an ancestor outside a kept unit, in the root unit, or in a standard
    unit beside parameters that are not kept."""
    model, module_fqn, first = context.model, record.module_fqn, record.first
    low = dtype_name(context.plan.dtype)
    dtype = record.tensor.dtype
    problems: list[LayoutProblem] = []
    if dtype != torch.float32:
        problems.append(degraded_problem(first, model, module_fqn, dtype, unit.label))
    read = _read_covering(context.read_directly, module_fqn)
    if read is not None and unit.kind != "kept":
        obstacle = context.reader_obstacles.get(read.module_fqn)
        frozen = context.replicate_frozen
        problems.append(read_problem(first, read, unit.label, frozen, low, obstacle))
    elif unit.kind == "root":
        reader = context.find_read(model, module_fqn) if module_fqn else None
        obstacle = None if module_fqn else context.root_obstacle
        problems.append(root_problem(first, model, module_fqn, low, reader, obstacle))
    elif unit.kind == "standard":
        not_kept = context.not_kept_owned
        problems.append(mixed_problem(first, model, module_fqn, unit.label, not_kept))
    return problems


def _assign_and_validate(
    model: nn.Module,
    plan: KeepPlan,
    units: Sequence[Unit],
    innermost: Callable[[str], int],
    *,
    replicate_frozen: bool,
    read_directly: Sequence[DirectRead] = (),
    reader_obstacles: Mapping[str, str] | None = None,
    find_read: ReadFinder = find_direct_read,
    root_obstacle: str | None = None,
) -> tuple[dict[str, str], list[str], list[LayoutProblem]]:
    """``(owner, replicated, problems)``: the unit label of every parameter name, the kept
    frozen parameters left out of FSDP2, and every problem found (empty when the layout holds).

    First every parameter is assigned its unit (:func:`_assign`), then the assignment is
    validated: parameters two units claim, kept ones whose unit cannot keep them
    (:func:`_kept_problems`), units of mixed trainable dtypes. ``innermost(module_fqn)`` is the
    index in ``units`` of the innermost unit around a module; ``find_read`` names who reads a
    root-owned kept parameter's module.
    """
    owned, not_kept_owned = _inventory(model, plan, innermost)
    assignment = _assign(owned, units, replicate_frozen=replicate_frozen)
    context = _KeptContext(
        model,
        plan,
        replicate_frozen,
        read_directly,
        reader_obstacles or {},
        find_read,
        root_obstacle,
        not_kept_owned,
    )
    problems: list[LayoutProblem] = []
    for record in assignment.claimed_twice:
        labels = sorted(units[index].label for index in record.units)
        problems.append(tied_problem(model, record.names, labels, record.tensor.dtype, record.kept))
    exempt: set[int] = set()  # already refused, or kept and FP32: never blamed for mixing
    for record, index in assignment.assigned:
        if not record.kept:
            continue
        found = _kept_problems(record, units[index], context)
        if found or record.tensor.dtype == torch.float32:
            exempt.add(id(record.tensor))
        problems += found
    problems += _mixed_dtype_problems(units, assignment.assigned, exempt)
    return assignment.owner, assignment.replicated, problems


def _mixed_dtype_problems(
    units: Sequence[Unit], assigned: Sequence[tuple[_Owned, int]], exempt: set[int]
) -> list[LayoutProblem]:
    """A problem for each trainable parameter of a unit of several trainable dtypes that is not
    of the unit's most common dtype, unless ``exempt`` (already refused, or kept and FP32)."""
    members: dict[int, list[_Owned]] = defaultdict(list)
    for record, index in assigned:
        if record.tensor.requires_grad:
            members[index].append(record)
    problems: list[LayoutProblem] = []
    for index, records in members.items():
        dtypes = Counter(record.tensor.dtype for record in records)
        if len(dtypes) < 2:
            continue
        majority = dtypes.most_common(1)[0][0]
        found = ", ".join(f"{count} {dtype_name(dtype)}" for dtype, count in dtypes.most_common())
        for record in records:
            if record.tensor.dtype == majority or id(record.tensor) in exempt:
                continue
            label = units[index].label
            problems.append(mixed_dtype_problem(record.first, record.tensor.dtype, label, found))
    return problems
