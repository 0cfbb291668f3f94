"""The methods other than ``forward`` that FSDP2 must gather a unit around, and registering them
so that a nested call gathers once.

Which methods (:func:`methods_to_gather`): from an observation where one was made
(:meth:`fp32keep.uses.observe.ParameterUse.coverage`: the methods that ran a unit's parameters while
no module of the unit was called); without one, none: whether a method runs a unit's
parameters only a run says (the source fallback warns where an ancestor calls one,
:func:`fp32keep.uses.source.unseen_uses`). Both
:func:`fp32keep.apply_fsdp2` and the contract's parity control (which re-shards the
implementation's units) use this one function.

Registering (:func:`register_gathered_methods`): torch's ``register_fsdp_forward_method``
wraps a method in the unit's forward pre- and post-hook, so a ``forward`` that calls the method
(or a method that calls another registered one) is resharded when the inner call returns and
goes on with sharded parameters (``mixed torch.Tensor and DTensor``). Here the unit counts how
deep it is in its own forward and gathered methods: only the outermost call gathers and
reshards, inner ones run as they are. A registered method that calls the unit's own forward
(``self(...)``) is resharded by FSDP2's forward hook when that returns; it is gathered again
there (one more all-gather), so the rest of the method still meets full parameters.

A gathered method is a collective, like ``forward``: every rank must call it (or none), or the
all-gather waits for the ranks that did not. Only methods that use the unit's parameters are
registered, so a pure helper (Kyutai's ``codec_model.get_encoded_length``) stays local.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from fp32keep._torch import fsdp_hooks
from fp32keep.errors import Fp32KeepTypeError, hidden_in_tracebacks
from fp32keep.uses.observe import ParameterUse, UnitMembers

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


def methods_to_gather(
    model: nn.Module, units: Iterable[UnitMembers], observed: ParameterUse | None
) -> dict[str, tuple[str, ...]]:
    """For each module of ``units``, the methods FSDP2 must gather its unit around (modules
    with none are left out), as ``observed`` saw them; none without an observation."""
    del model  # the layout's model: what ran on it is in ``observed``
    return {} if observed is None else dict(observed.coverage(units).methods)


class _Depth:
    """How deep one unit is in its own forward (``calls``) and gathered methods (``methods``)."""

    __slots__ = ("calls", "methods")

    def __init__(self) -> None:
        self.calls = 0
        self.methods = 0


def register_gathered_methods(
    model: nn.Module, units: Iterable[Sequence[str]], methods: Mapping[str, Sequence[str]]
) -> None:
    """Make FSDP2 gather each unit (its module FQNs, already sharded) around ``methods`` of its
    modules, as it does around ``forward``, outermost call only (see the module docstring)."""
    for modules in units:
        wanted = [(fqn, name) for fqn in modules for name in methods.get(fqn, ())]
        if not wanted:
            continue
        depth = _Depth()
        for fqn in modules:
            _count_calls(model.get_submodule(fqn), depth)
        for fqn, name in wanted:
            module = model.get_submodule(fqn)
            if not isinstance(module, FSDPModule):
                raise Fp32KeepTypeError(
                    f"{fqn or '<root>'} is not sharded: gather it around {name} after"
                )
            setattr(module, name, _gathered(module, name, depth))


def _count_calls(module: nn.Module, depth: _Depth) -> None:
    def enter(*_: Any) -> None:
        depth.calls += 1

    def leave(*_: Any) -> None:
        depth.calls -= 1
        if depth.methods and not depth.calls and sys.exc_info()[1] is None:
            # a gathered method called this unit's forward: FSDP2's post-forward hook, which
            # ran just before this one, resharded it; the method goes on, so gather it again
            module.unshard()  # type: ignore[operator]

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _gathered(module: FSDPModule, name: str, depth: _Depth) -> Any:
    method = getattr(module, name)

    @functools.wraps(method)
    def gathered(*args: Any, **kwargs: Any) -> Any:
        if depth.calls or depth.methods:  # inside the unit's forward or a gathered method
            return method(*args, **kwargs)
        # What torch's register_fsdp_forward_method runs around the method: the unit's forward
        # pre-hook (all-gather, post-backward hooks) and post-hook (reshard, pre-backward hook).
        args, kwargs = fsdp_hooks.unit_pre_forward(module, args, kwargs)
        depth.methods += 1
        try:
            out = method(*args, **kwargs)
        finally:
            depth.methods -= 1
        return fsdp_hooks.unit_post_forward(module, args, out)

    return gathered
