"""The parity control: the implementation's own unit layout, sharded with a known-correct policy.

Gradient parity cannot always be bit-exact: averaging a gradient over ``N`` ranks rounds unless
the arithmetic is exact (``N`` a power of two, or a low-precision gradient summed in a wider
reduce dtype), and FSDP2's hooks can make autograd accumulate in another order than the
unsharded model (T5's shared position bias). How much of that a correct implementation carries
depends on the world size and on the unit layout (which parameters reduce together, in which
dtype), so the control repeats exactly those: it reads the units the implementation under test
produced (:func:`unit_layout`), builds the model again from the same seed, casts it the correct
keep-aware way, and shards the *same* modules in the *same* groups on the *same* mesh, giving
each unit the policy the contract prescribes (:func:`~.policy.correct_policy`):
``param_dtype=None`` for a unit that holds only kept parameters, the caller's policy otherwise.
A unit that mixes kept parameters with others (a framework's block holding its kept router) is
the one part of the layout not repeated as is: no policy of one unit can gather both kinds
correctly, so the control gives the modules owning the kept ones units of their own inside it
(:func:`keeping_units`), and kept tensors are judged against units that keep them; over FP32
master weights on torch >= 2.15 one policy can (:func:`keeps_in_mixed_units`): the mixed unit is
repeated as is, its kept parameters gathered in FP32 by :func:`keeping_override`. Nothing else
is taken from the implementation, so whatever it does to the numbers beyond its layout (a bf16
all-gather or reduction of a kept tensor, a wrong scale) shows up as a difference the control
does not have.

The argument for why this bound is sound is written down in ``docs/contract.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import (
    KeepPlan,
    ParameterUse,
    UnitMembers,
    methods_to_gather,
    register_gathered_methods,
)
from pytest_fp32keep.contract.determinism import second_run_reason
from pytest_fp32keep.contract.follow import Choices, cast_following
from pytest_fp32keep.contract.fsdp_state import fsdp_units
from pytest_fp32keep.contract.parity_policy import ControlMeasure, control_errors, control_spread
from pytest_fp32keep.contract.policy import correct_policy
from pytest_fp32keep.contract.reference import seeded
from pytest_fp32keep.contract.scale import set_divide_factor
from pytest_fp32keep.contract.steps import Run, device_of, forward_backward, master_cast

__all__ = [
    "Unit",
    "control_run",
    "keeping_override",
    "keeping_units",
    "keeps_in_mixed_units",
    "measure_control",
    "sharding_order",
    "unit_layout",
]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One FSDP2 unit of a sharded model: the modules of one ``fully_shard`` call, the
    parameters (fully qualified names) that call manages, and whether it reshards after
    forward (no effect on the numbers, but a grouped unit some of whose modules do not run in
    forward needs ``False`` on some torch releases, so the control must repeat it)."""

    modules: tuple[str, ...]
    params: frozenset[str]
    reshard_after_forward: bool = True
    slots: frozenset[str] = frozenset()
    """Where the call found its parameters: ``module.name`` of each attribute it manages. Two
    units can hold the same tied parameter in different attributes (Transformers unties, shards,
    and ties again), which ``params`` (every name of each parameter) cannot tell apart."""
    groups: int = 1
    """How many FSDP2 param groups the call made (more than one: a ``shard_placement_fn`` put
    parameters on other process groups). The control shards the unit as one group on the
    contract's mesh."""

    def inside(self, other: Unit) -> bool:
        """Whether a module of this unit sits strictly inside a module of ``other``."""
        return self is not other and any(
            mine != theirs and (not theirs or mine.startswith(theirs + "."))
            for mine in self.modules
            for theirs in other.modules
        )


def _param_fqns(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            names.setdefault(id(param), []).append(_joined(fqn, name))
    return names


def unit_layout(model: nn.Module) -> tuple[Unit, ...]:
    """The FSDP2 units of ``model`` (sharded by anyone), one per ``fully_shard`` call.

    torch has no public API that lists what a unit holds; the reads of FSDP2's private state
    live in :mod:`.fsdp_state` (every attribute named, the torch releases verified, a clear
    :class:`~.fsdp_state.FsdpStateError` when torch changes them). A call whose parameters
    FSDP2 split into several param groups (per-parameter meshes) is one unit holding all of
    them; :attr:`Unit.groups` says how many.
    """
    fqn_of = {id(module): fqn for fqn, module in model.named_modules(remove_duplicate=False)}
    names = _param_fqns(model)
    units: list[Unit] = []
    for view in fsdp_units(model):
        params: set[str] = set()
        slots: set[str] = set()
        for managed in view.params:
            params.update(names.get(id(managed.parameter), []))
            slots.update(_joined(fqn_of[id(owner)], name) for owner, name in managed.attributes)
        modules = tuple(fqn_of[id(m)] for m in view.modules)
        units.append(
            Unit(
                modules,
                frozenset(params),
                view.reshards_after_forward,
                frozenset(slots),
                groups=len(view.groups),
            )
        )
    return tuple(units)


OVERRIDES_PARAM_DTYPE = "param_dtype_override_fn" in {
    field.name for field in dataclasses.fields(MixedPrecisionPolicy)
}
"""Whether this torch has ``MixedPrecisionPolicy(param_dtype_override_fn=...)`` (2.15 added it)."""


def keeps_in_mixed_units(master_dtype: torch.dtype | None, policy: MixedPrecisionPolicy) -> bool:
    """Whether one unit's policy can gather kept parameters in FP32 beside others in
    ``param_dtype``: over FP32 master weights (FSDP2 wants one original dtype per unit) on a torch
    with ``param_dtype_override_fn``, under a policy that reduces in 32 bits or more (a kept
    gradient is not averaged below FP32). The control then keeps a mixed unit as it is, with that
    override (:func:`keeping_override`), as a correct implementation can."""
    reduce_dtype = policy.reduce_dtype
    return (
        OVERRIDES_PARAM_DTYPE
        and master_dtype is not None
        and (reduce_dtype is None or torch.finfo(reduce_dtype).bits >= 32)
    )


def keeping_override(
    policy: MixedPrecisionPolicy, kept: Sequence[nn.Parameter]
) -> MixedPrecisionPolicy:
    """``policy`` with a ``param_dtype_override_fn`` that gathers ``kept`` in FP32 (held by the
    closure, recognised by identity) and every other parameter as ``policy`` says (its own
    override's answer, if it has one)."""
    by_id = {id(param): param for param in kept}
    callers = getattr(policy, "param_dtype_override_fn", None)

    def override(param: nn.Parameter) -> torch.dtype | None:
        if id(param) in by_id:
            return torch.float32
        return callers(param) if callers is not None else None

    # the field exists on torch >= 2.15 only (OVERRIDES_PARAM_DTYPE), so it is passed by name
    fields: dict[str, Any] = {"param_dtype_override_fn": override}
    return dataclasses.replace(policy, **fields)


def keeping_units(
    units: tuple[Unit, ...], model: nn.Module, plan: KeepPlan, *, in_place: bool = False
) -> tuple[tuple[Unit, ...], tuple[str, ...]]:
    """``units`` with every kept parameter of a mixed unit moved into a unit of its own: the
    module that owns it, when that module owns nothing else that is floating and is not the
    mixed unit's own module; and the note saying what was moved or could not be.

    The new unit sits inside the mixed one (it is sharded first), so the rest of the mixed unit
    keeps the caller's policy and its place in the layout. With ``in_place``
    (:func:`keeps_in_mixed_units`) nothing moves: each mixed unit keeps its kept parameters FP32
    by the override :func:`control_run` gives it."""
    if in_place:
        mixed = [u for u in units if {n for n in u.params if n in plan} not in (set(), u.params)]
        note = (
            f"the control keeps the kept parameters of {len(mixed)} mixed unit(s) in them, "
            "gathered in FP32 by torch's param_dtype_override_fn (FP32 master weights)"
        )
        return units, (note,) if mixed else ()
    owners: dict[str, list[str]] = {}  # owning module -> its kept parameters (every alias)
    for fqn, module in model.named_modules(remove_duplicate=False):
        own = [
            (_joined(fqn, name), param)
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False)
            if param.is_floating_point()
        ]
        if own and all(name in plan for name, _ in own):
            owners[fqn] = [name for name, _ in own]
    result: list[Unit] = []
    moved: list[str] = []
    stuck: list[str] = []
    for unit in units:
        kept = {name for name in unit.params if name in plan}
        if not kept or kept == unit.params:
            result.append(unit)
            continue
        apart = sorted(
            {o for o, names in owners.items() if o not in unit.modules and kept & set(names)}
        )
        taken = {name for owner in apart for name in owners[owner]} & unit.params
        for owner in apart:
            params = frozenset(owners[owner]) & unit.params
            slots = frozenset(s for s in unit.slots if s.rpartition(".")[0] == owner)
            result.append(Unit((owner,), params, unit.reshard_after_forward, slots))
        moved += apart
        stuck += sorted(kept - taken)
        rest = frozenset(unit.slots) - {s for s in unit.slots if s.rpartition(".")[0] in apart}
        result.append(dataclasses.replace(unit, params=unit.params - taken, slots=rest))
    notes = []
    if moved:
        notes.append(
            f"the implementation's units mix kept parameters with others; the control gives "
            f"{len(moved)} module(s) owning kept ones units of their own inside them "
            f"({', '.join(moved[:3])}{' …' if len(moved) > 3 else ''}), so kept tensors are "
            "judged against units that keep them"
        )
    if stuck:
        notes.append(
            f"the control cannot keep {', '.join(stuck[:3])}{' …' if len(stuck) > 3 else ''} "
            "apart (its module also owns parameters not kept, or is the mixed unit's own): it "
            "keeps the implementation's grouping for them"
        )
    return tuple(result), tuple(notes)


def _joined(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name


def sharding_order(units: tuple[Unit, ...]) -> list[Unit]:
    """``units`` with every unit before each unit it sits inside (``fully_shard`` manages the
    parameters not yet managed below it, so inner units must be sharded first)."""
    order: list[Unit] = []
    pending = list(units)
    while pending:
        ready = [u for u in pending if not any(o.inside(u) for o in pending if o is not u)]
        if not ready:  # units inside each other both ways: no order reproduces them
            raise RuntimeError(f"the units {[u.modules for u in pending]} nest in a cycle")
        order += ready
        pending = [u for u in pending if all(u is not r for r in ready)]
    return order


def _shard_like(
    model: nn.Module,
    units: tuple[Unit, ...],
    *,
    mesh: DeviceMesh,
    plan: KeepPlan,
    policy: MixedPrecisionPolicy,
    observed: ParameterUse | None,
    in_place: bool = False,
) -> None:
    """Shard ``model`` into ``units`` (inner units first, so each call manages the same
    parameters as the implementation's did), then check that it did. Each unit is gathered
    around the methods a correct implementation gathers it around (``observed``, else the
    source: :func:`fp32keep.methods_to_gather`); with ``in_place``, a mixed unit gathers its
    kept parameters in FP32 by :func:`keeping_override`."""
    modules = dict(model.named_modules(remove_duplicate=False))
    parameters = dict(model.named_parameters(remove_duplicate=False))
    managed = set().union(*(unit.params | unit.slots for unit in units)) if units else set()
    ignored = {param for name, param in parameters.items() if name not in managed}
    options: dict[str, Any] = {"ignored_params": ignored} if ignored else {}
    tie_back = _untie_across_units(model, units)
    for unit in sharding_order(units):
        targets = [modules[fqn] for fqn in unit.modules]
        unit_policy = correct_policy(unit.params, plan, policy)
        kept = [parameters[name] for name in sorted(unit.params) if name in plan]
        if in_place and kept and len(kept) < len(unit.params):  # a mixed unit
            unit_policy = keeping_override(unit_policy, kept)
        fully_shard(
            targets if len(targets) > 1 else targets[0],
            mesh=mesh,
            mp_policy=unit_policy,
            reshard_after_forward=unit.reshard_after_forward,
            **options,
        )
    members = [UnitMembers(unit.modules, unit.params) for unit in units]
    methods = methods_to_gather(model, members, observed)
    register_gathered_methods(model, [unit.modules for unit in units], methods)
    mirrored = {unit.modules: unit.slots for unit in unit_layout(model)}
    wanted = {unit.modules: unit.slots for unit in units}
    if mirrored != wanted:
        differs = sorted(
            "+".join(m) or "<root>"
            for m in {*mirrored, *wanted}
            if mirrored.get(m) != wanted.get(m)
        )
        raise RuntimeError(
            "the control could not reproduce the implementation's unit layout (units "
            f"{differs[:3]} manage other parameters when sharded inner units first)"
        )
    for slot, target in tie_back.items():
        setattr(*_attribute(model, slot), getattr(*_attribute(model, target)))


def _attribute(model: nn.Module, slot: str) -> tuple[nn.Module, str]:
    """The module and attribute name of ``slot`` (``module.name``, see :attr:`Unit.slots`)."""
    owner, _, name = slot.rpartition(".")
    return model.get_submodule(owner), name


def _untie_across_units(model: nn.Module, units: tuple[Unit, ...]) -> dict[str, str]:
    """Give a unit its own copy of a tied parameter that another unit also manages, and say
    where each copy must be tied back to once sharded.

    An implementation may shard one tied parameter in several units (Transformers unties before
    sharding and ties again after: T5's ``shared``, both ``embed_tokens`` and ``lm_head``), each
    gathering and reducing it on its own: a different order of work than one unit holding it,
    and one ``fully_shard`` call cannot manage an attribute another call manages. So the control
    does the same: the first unit to claim the parameter keeps it, each other unit gets one copy
    for its attributes, and after sharding every attribute is tied back to the first, as the model
    declares (FSDP2 adopts the re-tied parameter at its lazy init). Ties are always restored, so
    an implementation that leaves them broken differs from the control.
    """
    claimed: dict[int, tuple[int, str]] = {}
    tie_back: dict[str, str] = {}
    for index, unit in enumerate(units):
        copies: dict[int, nn.Parameter] = {}
        for slot in sorted(unit.slots):
            module, name = _attribute(model, slot)
            # the parameter registered directly under that name (None: none, or not a parameter)
            param = dict(module.named_parameters(recurse=False, remove_duplicate=False)).get(name)
            if param is None:
                continue
            first_index, first_slot = claimed.setdefault(id(param), (index, slot))
            if first_index == index:
                continue
            if id(param) not in copies:
                copies[id(param)] = nn.Parameter(
                    param.detach().clone(), requires_grad=param.requires_grad
                )
            setattr(module, name, copies[id(param)])
            tie_back[slot] = first_slot
    return tie_back


def control_run(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    *,
    units: tuple[Unit, ...],
    mesh: DeviceMesh,
    dtype: torch.dtype,
    master_dtype: torch.dtype | None,
    plan: KeepPlan,
    policy: MixedPrecisionPolicy,
    autocast: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    seed: int,
    observed: ParameterUse | None = None,
    divide_factor: float | None = None,
    choices: Choices | None = None,
) -> Run:
    """One run of the control: the model built under ``seed``, cast the correct way for
    ``master_dtype``, sharded into ``units`` with :func:`correct_policy`, run on ``batch``
    (deterministic algorithms on, as every run of the contract; ``observed``: what the
    reference's forward used, for the methods each unit is gathered around; ``divide_factor``:
    the gradient divide factor the caller declared, given to every unit, :mod:`.scale`;
    ``choices``: what the implementation chose where the contract allows either, which the
    control follows as the reference does, :mod:`.follow`)."""
    device = device_of(mesh)
    with seeded(seed):
        model = model_factory().to(device)

    def cast(model: nn.Module) -> None:
        if master_dtype is None:
            fp32keep.keep_aware_cast(model, dtype, plan=plan)
        else:
            master_cast(model, dtype, plan)

    cast_following(model, choices or Choices({}, {}, frozenset()), cast)
    in_place = keeps_in_mixed_units(master_dtype, policy)
    _shard_like(
        model, units, mesh=mesh, plan=plan, policy=policy, observed=observed, in_place=in_place
    )
    set_divide_factor(model.modules(), mesh, divide_factor)
    return forward_backward(
        model, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )


def measure_control(
    run: Callable[[], Run],
    reference: Run,
    observed: Run,
    *,
    units: tuple[Unit, ...],
    device: torch.device,
    measure_spread: bool,
    on_any_rank: Callable[[bool], bool],
    notes: Sequence[str] = (),
) -> ControlMeasure:
    """The control's errors against the ``reference``; and, where the runs are not known to be
    deterministic (:func:`~.determinism.second_run_reason`: an operator torch could not make
    deterministic in the reference, the implementation's run or the control's, a run off the
    CPU, or ``measure_spread``), the spread of a second control run.

    Whether to run again is agreed across the ranks (``on_any_rank``): the control runs FSDP2
    collectives, so every rank runs it the same number of times.
    """
    first = run()
    alerts = tuple(dict.fromkeys((*reference.alerts, *observed.alerts, *first.alerts)))
    why = second_run_reason(alerts, device, measure_spread)
    spread = None
    if on_any_rank(bool(why)):
        second = run()
        spread = control_spread(first.grads, second.grads, reference.grads)
        why = why or "another rank saw an operator torch could not make deterministic"
    grouped = [
        f"{'+'.join(u.modules) or '<root>'}: {u.groups} param groups" for u in units if u.groups > 1
    ]
    notes = tuple(notes) + (
        (
            f"{len(grouped)} unit(s) hold several param groups (per-parameter meshes; "
            f"{', '.join(grouped[:3])}{' …' if len(grouped) > 3 else ''}); the control shards "
            "each as one group on the contract's mesh",
        )
        if grouped
        else ()
    )
    return ControlMeasure(control_errors(first.grads, reference.grads), spread, why, notes)
