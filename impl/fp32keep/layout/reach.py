"""Parameters of the units fp32keep makes that code outside the unit reaches: refused. Pure.

fp32keep makes units a plain FSDP2 wrap would not: every child of a root that owns only kept
parameters (Blip2's ``query_tokens``: the root is an FP32 unit, so each child leaves it), the
children of an owner unit (a module owning only kept ``sinks``), kept units, tie groups. FSDP2
all-gathers a unit only around the forward (and the registered methods) of its own modules. A
parameter of such a unit that code outside the unit uses, by reading it
(``F.linear(h, self.decoder.head.weight)`` in the root) or by calling a module inside the unit
that is no unit itself (``self.decoder.head(h)``), meets the sharded ``DTensor``: the model would
be sharded, then fail at its first forward with ``mixed torch.Tensor and DTensor``. Such a
layout is refused before anything is sharded (``read-not-called``), naming the parameter, its
module and unit, the reader and what it reads.

What ran is best observed (:meth:`fp32keep.uses.observe.ParameterUse.coverage`: a parameter used
while no module of its unit ran); without an observation the source is read
(:func:`fp32keep.uses.source.uses_from_outside`: ``self.PATH.TENSOR`` and ``self.PATH(...)`` in
the methods of the unit's ancestors outside it). The source cannot see a read or a call it does
not spell through ``self`` (see :mod:`fp32keep.uses.source`); the observation can.

The caller's own units (its wrap targets, the root with its policy) are left as they were: a
read there fails the same under a plain ``fully_shard`` of the same units, and kept parameters
used outside any unit are refused by :func:`fp32keep.layout.planning.plan_layout` already.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import nn

from fp32keep.errors import LayoutProblem, hidden_in_tracebacks
from fp32keep.layout.problems import outside_use_problem, uncovered_problem
from fp32keep.layout.units import Unit
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.tensors import dtype_name
from fp32keep.uses.observe import CALL, ParameterUse, Stack, UnitMembers, format_stack
from fp32keep.uses.source import DirectRead, uses_from_outside

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


def _inside(fqn: str, modules: Collection[str]) -> bool:
    return any(not m or fqn == m or fqn.startswith(m + ".") for m in modules)


def why_made(unit: Unit, owners: Sequence[str], model: nn.Module) -> str:
    """Why fp32keep made ``unit``: for the refusal to say (and which kept parameters to freeze
    so that it is not made)."""
    if unit.kind == "kept":
        return "a kept unit, all-gathered in FP32"
    if len(unit.module_fqns) > 1:
        return "the modules of one tied tensor, grouped into one unit"
    for owner in sorted(owners, key=len, reverse=True):  # the nearest owner around it
        if all(_inside(fqn, [owner]) and fqn != owner for fqn in unit.module_fqns):
            module = model.get_submodule(owner)
            kept = ", ".join(name for name, _ in module.named_parameters(recurse=False))
            where = repr(owner) if owner else "the root module"
            return (
                f"split out of {where} ({type(module).__name__}), an FP32 unit owning only kept "
                f"parameters ({kept}); freezing those (requires_grad_(False): then replicated) "
                f"leaves {where} no FP32 unit and this module in its unit"
            )
    return "a unit fp32keep made"  # pragma: no cover - every other unit is an owner's child


def outside_uses(
    model: nn.Module,
    plan: KeepPlan,
    units: Sequence[Unit],
    members: Sequence[UnitMembers],
    callers: Collection[str],
    owners: Sequence[str],
    observed: ParameterUse | None,
    refused: Collection[str] = (),
) -> list[LayoutProblem]:
    """A problem for each parameter that code outside its unit uses: any kept one (observed
    only), and any of a unit fp32keep made (observed, else read from the source): every unit
    but the caller's, its wrap targets (``callers``, one module each) and the root with its
    policy. ``members`` are the units' modules and parameters, ``owners`` the FP32 owner units
    (:class:`fp32keep.layout.kept.KeptSelection`), ``refused`` names parameters already refused
    for another reason."""
    low = dtype_name(plan.dtype)
    made = {
        index
        for index, unit in enumerate(units)
        if unit.kind != "root"
        and not (len(unit.module_fqns) == 1 and unit.module_fqns[0] in callers)
    }
    problems: list[LayoutProblem] = []
    if observed is not None:
        unit_of = {name: index for index, unit in enumerate(members) for name in unit.params}
        for name, stack in observed.coverage(members).uncovered.items():
            index = unit_of[name]
            if name in refused:
                continue
            if name in plan.param_names:
                problems.append(uncovered_problem(name, units[index].label, stack, low))
            elif index in made:
                read = _observed_read(model, name, stack, units[index].module_fqns)
                why = why_made(units[index], owners, model)
                called = (read.module_fqn, CALL) in stack
                problems.append(
                    outside_use_problem(name, units[index].label, read, why, model, called=called)
                )
        return problems
    for index in sorted(made):
        unit = units[index]
        if "" in unit.module_fqns:
            continue  # the root's own forward runs around every use
        why = why_made(unit, owners, model)
        for name, read, called in _source_uses(model, unit.module_fqns, members[index].params):
            if name not in refused:
                problems.append(
                    outside_use_problem(name, unit.label, read, why, model, called=called)
                )
    return problems


def _source_uses(
    model: nn.Module, modules: Sequence[str], params: Collection[str]
) -> list[tuple[str, DirectRead, bool]]:
    """:func:`fp32keep.uses.source.uses_from_outside` for the unit of ``modules`` managing
    ``params``."""
    owned: dict[str, set[str]] = {}
    for name in params:
        module_fqn, _, attribute = name.rpartition(".")
        owned.setdefault(module_fqn, set()).add(attribute)
    return uses_from_outside(model, modules, owned)


def _observed_read(model: nn.Module, name: str, stack: Stack, modules: Sequence[str]) -> DirectRead:
    """The use of ``name`` in ``stack`` as a read: by the innermost running module outside the
    unit of ``modules``, of the name relative to it (a call of a module inside the unit that is
    no unit itself shows in the stack)."""
    outside = [(fqn, method) for fqn, method in stack if not _inside(fqn, modules)]
    reader_fqn, method = outside[-1] if outside else ("", "")
    reader = type(model.get_submodule(reader_fqn)).__name__
    expression = name[len(reader_fqn) + 1 :] if name.startswith(reader_fqn + ".") else name
    where = f"{reader}.{method}" if method and method != CALL else reader
    evidence = f"observed in {format_stack(stack)}"
    return DirectRead(name.rpartition(".")[0], where, expression, reader_fqn, evidence)
