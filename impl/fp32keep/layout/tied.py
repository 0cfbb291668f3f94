"""Tied parameters whose aliases' modules would fall in different FSDP2 units. Pure.

FSDP2 manages a parameter in exactly one ``fully_shard`` call and all-gathers it only around the
forward of that call's modules. A tensor tied between two modules of different units (an input
embedding the root calls itself and the ``lm_head`` inside the language model; a kept embedding
and the kept head of another block) would meet the other unit's forward sharded. One call can
hold several modules, though: ``fully_shard([module_a, module_b])`` all-gathers the group when
the first of them starts its forward and reshards it once all that started have finished. So the
aliases' modules become one unit of their own (:func:`tie_groups`), where that holds:

* no alias is owned by the root (the root is the outermost unit: nothing can group it) and no
  alias's module lies inside another's (one call cannot hold a module and its descendant);
* every module has a forward of its own (FSDP2's hooks never fire on a container);
* a module that already is a unit is that unit's only module (a ``group_kept`` group or another
  tie's group is not split), and of the same kind;
* a kept tensor's modules hold only kept floating parameters (a kept unit all-gathers in FP32
  whatever it holds).

Otherwise the layout keeps the ``tied-across-units`` refusal. Such a group can span depths (an
embedding deep in the language model, the head near its top), so units are sharded in
:func:`sharding_order`, not by depth alone.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol, TypeVar

from torch import nn

from fp32keep.errors import hidden_in_tracebacks
from fp32keep.layout.kept import has_own_forward
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.tensors import iter_owned

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

TieGroup = tuple[Literal["kept", "standard"], tuple[str, ...]]
"""A unit to add: its kind and the modules (first name of each) one ``fully_shard`` holds."""


class _Planned(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def module_fqns(self) -> tuple[str, ...]: ...
    @property
    def depth(self) -> int: ...


U = TypeVar("U", bound=_Planned)


def tie_groups(
    model: nn.Module,
    plan: KeepPlan,
    unit_modules: Mapping[str, tuple[str, tuple[str, ...]]],
    innermost: Callable[[str], int],
    below: Mapping[str, Sequence[str]],
) -> list[TieGroup]:
    """The units that put each tied parameter's modules together, where they can (see the
    module docstring); parameters already inside one unit, or that cannot be grouped, get none.

    Args:
        model: the model being laid out.
        plan: its keep plan.
        unit_modules: for every module that is a unit's module, that unit's kind and modules.
        innermost: the index of the innermost unit around a module FQN.
        below: for every module FQN, the floating parameter names (all aliases) in its subtree
            (:func:`fp32keep.layout.kept.float_param_names`).
    """
    owners: dict[int, dict[int, str]] = defaultdict(dict)
    names: dict[int, list[str]] = defaultdict(list)
    modules: dict[str, nn.Module] = {}
    for module_fqn, module, attribute, tensor, is_param in iter_owned(model):
        if is_param:
            # A module reached under two names (T5's ``shared`` and ``encoder.embed_tokens``
            # may be one object) is one member: the first name is the one fully_shard gets.
            owners[id(tensor)].setdefault(id(module), module_fqn)
            names[id(tensor)].append(f"{module_fqn}.{attribute}" if module_fqn else attribute)
            modules.setdefault(module_fqn, module)
    groups: list[TieGroup] = []
    grouped: set[str] = set()
    for key, by_module in owners.items():
        fqns = tuple(sorted(by_module.values()))
        if len(fqns) < 2 or len({innermost(fqn) for fqn in fqns}) < 2:
            continue
        kept = any(name in plan.param_names for name in names[key])
        group: TieGroup = ("kept" if kept else "standard", fqns)
        if group in groups:  # a weight and a bias tied between the same modules
            continue
        if grouped.intersection(fqns) or not _can_group(group, modules, plan, unit_modules, below):
            continue
        groups.append(group)
        grouped.update(fqns)
    return groups


def _can_group(
    group: TieGroup,
    modules: Mapping[str, nn.Module],
    plan: KeepPlan,
    unit_modules: Mapping[str, tuple[str, tuple[str, ...]]],
    below: Mapping[str, Sequence[str]],
) -> bool:
    kind, fqns = group
    if "" in fqns or any(b.startswith(a + ".") for a in fqns for b in fqns):
        return False
    for fqn in fqns:
        if not has_own_forward(modules[fqn]):
            return False
        unit = unit_modules.get(fqn)
        if unit is not None and (unit[1] != (fqn,) or unit[0] != kind):
            return False
        if kind == "kept" and not all(name in plan.param_names for name in below.get(fqn, ())):
            return False
    return True


def sharding_order(units: Sequence[U]) -> list[U]:
    """Children before parents: ``fully_shard`` claims the parameters not yet claimed below it,
    so every unit comes after each unit with a module inside one of its modules.

    Deepest first, kept before others at one depth, else in the order given; a group whose
    modules lie at several depths (a tie group: an embedding deep in the language model and its
    head near the top) waits for what lies inside any of its modules, whatever its depth.
    """
    unit_of_module = {fqn: index for index, unit in enumerate(units) for fqn in unit.module_fqns}
    outer: dict[int, set[int]] = defaultdict(set)
    for index, unit in enumerate(units):
        for fqn in unit.module_fqns:
            parts = fqn.split(".") if fqn else []
            for cut in range(len(parts)):
                around = unit_of_module.get(".".join(parts[:cut]))
                if around is not None and around != index:
                    outer[index].add(around)
    waiting = Counter(around for arounds in outer.values() for around in arounds)

    def key(index: int) -> tuple[int, bool, int]:
        return (-units[index].depth, units[index].kind != "kept", index)

    ready = [key(index) for index in range(len(units)) if not waiting[index]]
    heapq.heapify(ready)
    ordered: list[U] = []
    while ready:
        index = heapq.heappop(ready)[2]
        ordered.append(units[index])
        for around in outer[index]:
            waiting[around] -= 1
            if not waiting[around]:
                heapq.heappush(ready, key(around))
    if len(ordered) != len(units):  # pragma: no cover - tie groups never nest both ways
        raise AssertionError(f"units nest in a cycle: {[u.module_fqns for u in units]}")
    return ordered
