"""The records a layout is made of: :class:`Unit` (one planned ``fully_shard`` call) and
:class:`Layout` (every unit of a model in sharding order). Pure data, read-only and hashable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from fp32keep.errors import hidden_in_tracebacks
from fp32keep.frozen import FrozenMapping

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

UnitKind = Literal["kept", "standard", "root"]


@dataclass(frozen=True)
class Unit:
    """One planned ``fully_shard`` call.

    Attributes:
        kind: ``"kept"``, ``"standard"`` or ``"root"``.
        module_fqns: the modules sharded together (one, or several for a grouped kept unit).
        depth: nesting depth of the deepest module, used to shard children before parents.
        stays_gathered: all-gathered once per step and not resharded after forward (the
            model-wide kept unit: resharding it would all-gather every kept parameter of the
            model again in backward).
    """

    kind: UnitKind
    module_fqns: tuple[str, ...]
    depth: int
    stays_gathered: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "module_fqns", tuple(self.module_fqns))  # read-only, hashable

    @property
    def label(self) -> str:
        """A readable name for messages."""
        names = [fqn or "<root>" for fqn in self.module_fqns]
        return names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"


@dataclass(frozen=True)
class Layout:
    """The units of a model in sharding order (children before parents, root last).

    Read-only through and through: its collections are tuples and
    :class:`fp32keep.frozen.FrozenMapping` s (copies of what it was built from), so a layout
    cannot be changed after :func:`plan_layout` checked it, and it is hashable.

    Attributes:
        units: the planned units.
        owner: for every parameter name (all aliases), the label of the unit that owns it
            (``"<replicated>"`` for the replicated ones).
        replicated: kept, frozen parameters that no unit can isolate: left out of FSDP2
            (``ignored_params``), so every rank holds them whole, in FP32, never cast.
        forward_methods: for each module of a unit, the methods other than ``forward`` FSDP2
            gathers the unit around (:mod:`fp32keep.shard.gathered`): collectives, like forward.
        keeps: how the kept parameters stay FP32: ``"units"``, in kept units of their own
            sharded without the caller's ``param_dtype``; ``"policy"``, inside the caller's own
            units, by the policy's ``param_dtype_override_fn`` (:mod:`fp32keep.shard.keep_policy`).
        why: why :func:`fp32keep.apply_fsdp2` chose ``keeps`` (empty where nobody chose).
    """

    units: tuple[Unit, ...]
    owner: Mapping[str, str]
    replicated: tuple[str, ...] = ()
    forward_methods: Mapping[str, tuple[str, ...]] = field(default_factory=FrozenMapping)
    keeps: Literal["units", "policy"] = "units"
    why: str = ""

    def __post_init__(self) -> None:
        freeze = object.__setattr__
        freeze(self, "units", tuple(self.units))
        freeze(self, "owner", FrozenMapping(self.owner))
        freeze(self, "replicated", tuple(self.replicated))
        methods = FrozenMapping((fqn, tuple(names)) for fqn, names in self.forward_methods.items())
        freeze(self, "forward_methods", methods)

    def describe(self) -> str:
        """A readable list of units in sharding order."""
        lines = [
            f"{unit.kind:<10} {unit.label}"
            + (" (stays gathered from forward to backward)" if unit.stays_gathered else "")
            + "".join(
                f"; gathered around {fqn or '<root>'}.{method}"
                for fqn in unit.module_fqns
                for method in self.forward_methods.get(fqn, ())
            )
            for unit in self.units
        ]
        lines += [f"{'replicated':<10} {name}" for name in self.replicated]
        if self.why:
            how = "in kept units" if self.keeps == "units" else "by the policy's override"
            lines.insert(0, f"kept parameters stay FP32 {how}: {self.why}")
        return "\n".join(lines)
