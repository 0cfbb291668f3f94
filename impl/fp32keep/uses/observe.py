"""Which module calls and methods use each parameter of a model: observed, not guessed.

FSDP2 all-gathers a unit's parameters around the unit's forward (its forward hooks) and around
the methods registered with ``register_fsdp_forward_method``, nowhere else. Whether a model's
code reads a kept module's weight without calling the module (Voxtral's encoder adds
``embed_positions.weight``), or runs a unit through another method (Apertus 1.5's
``self.audio_tokenizer.encode(...)``), is a fact about a run of that code, which the source only
hints at (:mod:`fp32keep.uses.source` is the fallback for a caller with no inputs to run).

:func:`observe_parameter_use` records it during a forward of the *unsharded* model: every
operator that takes a parameter (a ``TorchDispatchMode``, which sees through Python wrappers,
custom kernels and autocast, and never sees the metadata reads — ``.dtype``, ``.shape`` — that
work on a sharded tensor too), with the model's modules running at that moment, read from the
Python stack: a call through ``nn.Module.__call__`` (where FSDP2's hooks run), and any method of
the module's class (``encode``, an inherited ``forward``, a helper on a base class). Operators
run by autograd's backward, and any with none of the model's frames on the stack (a deepcopy, a
state dict, an optimizer step), are not the model's code running and are not recorded.

A :class:`ParameterUse` answers, for any unit layout: which parameters are read while no module
of their unit runs (:meth:`ParameterUse.direct_read`, :attr:`Coverage.uncovered`), and which
methods other than a call run a unit's parameters, outermost only, so a method that ``forward``
calls is not one (:attr:`Coverage.methods`). :func:`fp32keep.apply_fsdp2` makes one on
``example_inputs=``, or takes the caller's (``observed=``), instead of reading the source.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, NamedTuple, TypeAlias

import torch
from torch import nn

from fp32keep._torch.dispatch import TorchDispatchMode, backward_running
from fp32keep._torch.modules import call_impl_code
from fp32keep.errors import Fp32KeepValueError, hidden_in_tracebacks
from fp32keep.tensors import check_module
from fp32keep.uses.source import DirectRead

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

#: The method name of a call through ``nn.Module.__call__``: FSDP2's forward hooks run there.
CALL = "__call__"
Frame: TypeAlias = tuple[str, str]
"""A module of the model running: ``(module fqn, method)``, the method :data:`CALL` for a call."""
Stack: TypeAlias = tuple[Frame, ...]
"""The model's frames at one use of a parameter, outermost first."""

_CALL_CODE = call_impl_code()


class UnitMembers(NamedTuple):
    """One FSDP2 unit: the modules of its ``fully_shard`` call and the parameter names (any
    alias) it manages."""

    modules: tuple[str, ...]
    params: Collection[str]


@dataclass(frozen=True)
class Coverage:
    """How a unit layout meets what was observed.

    Attributes:
        methods: for each module of a unit, the methods other than a call that ran the unit's
            parameters while no module of the unit was called (outermost only): FSDP2 must
            gather the unit around them.
        uncovered: parameters (first alias in their unit) used while no module of their unit
            ran at all, each with one such stack: FSDP2 would never gather them there.
    """

    methods: Mapping[str, tuple[str, ...]]
    uncovered: Mapping[str, Stack]


def _unit_frames(stack: Stack, modules: Collection[str]) -> list[Frame]:
    return [frame for frame in stack if frame[0] in modules]


class ParameterUse:
    """What :func:`observe_parameter_use` saw: for each parameter, the distinct stacks of the
    model's module calls and methods it was used under. Complete once the ``with`` block ends;
    picklable, and :meth:`merged` with other ranks' observations."""

    def __init__(
        self,
        model_name: str,
        aliases: Mapping[str, Sequence[str]],
        stacks: Mapping[str, Iterable[Stack]] | None = None,
        *,
        complete: bool = True,
    ) -> None:
        self.model_name = model_name
        self._aliases = {name: tuple(names) for name, names in aliases.items()}
        self._canonical = {alias: name for name, names in aliases.items() for alias in names}
        self._stacks: dict[str, set[Stack]] = {
            name: set(found) for name, found in (stacks or {}).items() if found
        }
        self.complete = complete

    @property
    def param_names(self) -> frozenset[str]:
        """Every name (tied aliases included) of every parameter of the observed model."""
        return frozenset(self._canonical)

    @property
    def used(self) -> frozenset[str]:
        """The parameters (first name) some recorded operator took."""
        return frozenset(self._stacks)

    def stacks(self, name: str) -> frozenset[Stack]:
        """The distinct stacks ``name`` (any alias) was used under; empty if never used."""
        return frozenset(self._stacks.get(self._canonical.get(name, name), ()))

    def _record(self, name: str, stack: Stack) -> None:
        self._stacks.setdefault(name, set()).add(stack)

    def merged(self, others: Iterable[ParameterUse]) -> ParameterUse:
        """This observation and ``others`` (of the same model) as one: every use any saw."""
        stacks = {name: set(found) for name, found in self._stacks.items()}
        for other in others:
            for name, found in other._stacks.items():
                stacks.setdefault(name, set()).update(found)
        return ParameterUse(self.model_name, self._aliases, stacks)

    def digest(self) -> str:
        """A hash of everything observed: equal digests, equal observations."""
        text = repr((self.model_name, sorted(self._aliases.items()), self._sorted_stacks()))
        return hashlib.sha256(text.encode()).hexdigest()

    def _sorted_stacks(self) -> list[tuple[str, list[Stack]]]:
        return [(name, sorted(found)) for name, found in sorted(self._stacks.items())]

    def misfit(self, model: nn.Module) -> str | None:
        """Why this observation is not of ``model`` (other parameter names), or ``None``."""
        names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        if names == self.param_names:
            return None
        extra, missing = sorted(names - self.param_names), sorted(self.param_names - names)
        return (
            f"the observation is of {self.model_name}, whose parameters differ from "
            f"{type(model).__name__}'s ({len(extra)} not observed, e.g. {extra[:3]}; "
            f"{len(missing)} observed but absent, e.g. {missing[:3]}); observe the model you "
            "shard, before sharding it"
        )

    def direct_read(self, model: nn.Module, module_fqn: str) -> DirectRead | None:
        """An observed use of a parameter ``module_fqn`` owns directly while that module ran
        neither a call nor a method: the innermost running ancestor read it. ``None`` if none.

        A use while another owner of a tied alias ran (a tied ``lm_head`` using the embedding's
        weight) is that owner's call, not a read: the layout puts tied owners in one unit.
        """
        module = model.get_submodule(module_fqn)
        for attribute, _ in module.named_parameters(recurse=False):
            name = f"{module_fqn}.{attribute}" if module_fqn else attribute
            canonical = self._canonical.get(name, name)
            owners = {module_fqn} | {
                alias.rpartition(".")[0] for alias in self._aliases.get(canonical, ())
            }
            for stack in sorted(self.stacks(name)):
                if _unit_frames(stack, owners):
                    continue
                ancestors = [
                    (fqn, method)
                    for fqn, method in stack
                    if not fqn or module_fqn.startswith(fqn + ".")
                ]
                reader_fqn, method = ancestors[-1] if ancestors else ("", "")
                reader = type(model.get_submodule(reader_fqn)).__name__
                if method == CALL:  # a hook, or a __call__ that runs no forward
                    where = f"a hook or call of {reader} (not its forward)"
                else:
                    where = f"{reader}.{method}" if method else "no module call"
                expression = name[len(reader_fqn) + 1 :] if reader_fqn else name
                evidence = f"observed in {where}"
                return DirectRead(module_fqn, reader, expression, reader_fqn, evidence)
        return None

    def coverage(self, units: Iterable[UnitMembers]) -> Coverage:
        """How ``units`` meet the observed uses (see :class:`Coverage`)."""
        methods: dict[str, set[str]] = {}
        uncovered: dict[str, Stack] = {}
        for unit in units:
            modules = set(unit.modules)
            shown = {self._canonical.get(name, name): name for name in sorted(unit.params)}
            for canonical, name in shown.items():
                for stack in sorted(self._stacks.get(canonical, ())):
                    frames = _unit_frames(stack, modules)
                    if any(method == CALL for _, method in frames):
                        continue
                    if frames:
                        fqn, method = frames[0]
                        methods.setdefault(fqn, set()).add(method)
                    else:
                        uncovered.setdefault(name, stack)
        return Coverage({fqn: tuple(sorted(found)) for fqn, found in methods.items()}, uncovered)

    def describe(self) -> str:
        """Each parameter used, with the stacks it was used under (innermost frame last)."""
        return "\n".join(
            f"{name}: {format_stack(stack)}"
            for name, found in self._sorted_stacks()
            for stack in found
        )

    def __repr__(self) -> str:
        state = "" if self.complete else ", recording"
        return f"ParameterUse({self.model_name}, {len(self._stacks)} parameters used{state})"


def format_stack(stack: Stack) -> str:
    """A stack as people read it: ``encoder.forward > encoder.layers.0.__call__``."""
    return " > ".join(f"{fqn or '<root>'}.{method}" for fqn, method in stack) or "no module"


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records each operator that takes a parameter of the model, with the model's frames."""

    supports_higher_order_operators = True

    def __init__(self, model: nn.Module, use: ParameterUse) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._use = use
        # autograd's engine runs backward operators with no model code on the stack; a use
        # there says nothing about forward
        self._in_backward = backward_running()
        self._param_of: dict[int, tuple[nn.Parameter, str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self._param_of.setdefault(id(param), (param, name))
        self._module_of = {id(m): (m, fqn) for fqn, m in model.named_modules()}
        self._methods: dict[tuple[type, CodeType], str | None] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self._in_backward():
            return result
        used = self._params_in(args) | self._params_in(kwargs.values())
        stack = self._stack(sys._getframe(1)) if used else ()
        for name in used if stack else ():  # no frame: not the model's code (a deepcopy, a step)
            self._use._record(name, stack)
        return result

    def _params_in(self, values: Iterable[Any]) -> set[str]:
        found = set()
        for value in values:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                hit = self._param_of.get(id(item)) if isinstance(item, torch.Tensor) else None
                if hit is not None and hit[0] is item:
                    found.add(hit[1])
        return found

    def _stack(self, frame: FrameType | None) -> Stack:
        frames: list[Frame] = []
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                owner = frame.f_locals.get("self")
                hit = self._module_of.get(id(owner))
                if hit is not None and hit[0] is owner:
                    module, _ = hit
                    method = CALL if code is _CALL_CODE else self._method(module, code)
                    if method is not None:
                        frames.append((hit[1], method))
            frame = frame.f_back
        frames.reverse()
        return tuple(frames)

    def _method(self, module: nn.Module, code: CodeType) -> str | None:
        """``code``'s name if it is the body of that method of ``module``'s class (not a
        decorator's wrapper, not ``nn.Module``'s plumbing), else ``None``."""
        key = (type(module), code)
        if key not in self._methods:
            found = inspect.getattr_static(type(module), code.co_name, None)
            body = getattr(inspect.unwrap(found), "__code__", None) if callable(found) else None
            plumbing = code.co_name == CALL or code.co_filename == _CALL_CODE.co_filename
            self._methods[key] = code.co_name if body is code and not plumbing else None
        return self._methods[key]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def observe_parameter_use(model: nn.Module) -> contextlib.AbstractContextManager[ParameterUse]:
    """Record, inside the ``with`` block, which module calls and methods use each parameter.

    Run one forward of the *unsharded* model in it, on inputs that take the code paths training
    takes (the loss and a backward may run too; backward is not recorded), on every rank, then
    hand the observation to :func:`fp32keep.apply_fsdp2` (``observed=``), which lays out the
    units from it instead of from the source::

        with fp32keep.observe_parameter_use(model) as observed:
            model(**batch).loss.backward()
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, observed=observed)

    Only code that runs is seen: a method your training never calls (Kyutai's
    ``codec_model.encode``, used by ``generate``) is not registered; run it inside the block
    too if the sharded model must run it. Inside the block autocast's weight cache is off (an
    ``autocast`` made there inherits that; ``cache_enabled=True`` would hide every use of a
    weight after its first): a weight used several times under autocast then gets its gradient
    summed in FP32 instead of in the low dtype, so observe a forward of its own rather than a
    step whose gradients you compare bit for bit.

    Raises (at the call, before the ``with`` block):
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is already sharded (its parameters are DTensors).
    """
    check_module(model, where="observe_parameter_use")
    sharded = [name for name, param in model.named_parameters() if _is_dtensor(param)]
    if sharded:
        raise Fp32KeepValueError(
            f"observe_parameter_use: {type(model).__name__} is already sharded ({sharded[:3]} are "
            "DTensors); observe the unsharded model before apply_fsdp2"
        )
    return _observing(model)


@contextlib.contextmanager
def _observing(model: nn.Module) -> Iterator[ParameterUse]:
    """The recording itself: :func:`observe_parameter_use` after its checks."""
    aliases: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(first.setdefault(id(param), name), []).append(name)
    use = ParameterUse(type(model).__name__, aliases, complete=False)
    # autocast casts a weight once per region and hands the cached copy to every later use, so
    # those uses would show no parameter at all; without the cache each use casts, and is seen
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with _Recorder(model, use):
            yield use
    finally:
        torch.set_autocast_cache_enabled(cache)
        use.complete = True
