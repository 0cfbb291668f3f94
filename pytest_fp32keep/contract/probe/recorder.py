"""The machinery under the probe: module selection, call frames and the operator recorder.

It owns which modules a probe watches (:data:`ModuleSelector`), the per-thread stack frame of
one active probed call (:class:`_Frame`), and the one ``TorchDispatchMode`` per thread that
feeds every operator to the probes with a call active (:func:`_activate`, :func:`_deactivate`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeAlias

from torch import nn

from pytest_fp32keep.contract.probe.records import Phase, TensorLeaf
from pytest_fp32keep.contract.torch_dispatch import TorchDispatchMode

ModuleSelector: TypeAlias = Callable[[str, nn.Module], bool] | Iterable[str] | str | None
"""Which modules to probe: ``None`` (all), a predicate ``(fqn, module) -> bool``, or FQNs."""


def _select_modules(model: nn.Module, modules: ModuleSelector) -> dict[nn.Module, str]:
    named = dict(model.named_modules())
    if modules is None:
        chosen = named
    elif callable(modules):
        predicate = modules
        chosen = {fqn: module for fqn, module in named.items() if predicate(fqn, module)}
    else:
        wanted = [modules] if isinstance(modules, str) else list(modules)
        unknown = [fqn for fqn in wanted if fqn not in named]
        if unknown:
            known = ", ".join(repr(fqn) for fqn in list(named)[:8])
            raise ValueError(
                f"DtypeProbe: {type(model).__name__} has no module named {unknown}; "
                f"names are FQNs from model.named_modules(), e.g. {known}"
            )
        chosen = {fqn: module for fqn, module in named.items() if fqn in wanted}
    if not chosen:
        raise ValueError(f"DtypeProbe: the module selector {modules!r} selects no module")
    return {module: fqn for fqn, module in chosen.items()}


class _OpSink(Protocol):
    """What the recorder feeds: :class:`~pytest_fp32keep.contract.probe.DtypeProbe`."""

    def _record_op(self, func: Any, args: Any, kwargs: Any, result: Any) -> None: ...


class _Frame:
    """One active probed module call on a thread's stack."""

    __slots__ = ("call", "fqn", "inputs", "module", "phase")

    def __init__(self, module: nn.Module, fqn: str, call: int) -> None:
        self.module = module
        self.fqn = fqn
        self.call = call
        # "hooks" until the probe's pre-hook runs: FSDP2's prepended pre-hook runs in between.
        self.phase: Phase = "hooks"
        self.inputs: tuple[TensorLeaf, ...] = ()


# torch's TorchDispatchMode is untyped; the ignores below are about its signatures only.
class _OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """One dispatch mode per thread, shared by every probe that has a module call active.

    Sharing it (entered when the first probe becomes active on a thread, left when the last one
    becomes idle) keeps the mode stack strictly LIFO even when two probes watch the same module
    and their hooks interleave.
    """

    # Higher-order operators (e.g. flex attention) pass through as one recorded operator
    # instead of raising NotImplementedError under the mode.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.active: list[_OpSink] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # The mode is popped while this runs, so the call below is exactly the operator
        # autograd and autocast asked for; recording reads metadata only.
        result = func(*args, **kwargs)
        for probe in tuple(self.active):
            probe._record_op(func, args, kwargs, result)
        return result


_thread_state = threading.local()


def _recorder() -> _OpRecorder:
    recorder: _OpRecorder | None = getattr(_thread_state, "recorder", None)
    if recorder is None:
        recorder = _OpRecorder()
        _thread_state.recorder = recorder
    return recorder


def _activate(probe: _OpSink) -> None:
    recorder = _recorder()
    if probe in recorder.active:
        return
    recorder.active.append(probe)
    if len(recorder.active) == 1:
        recorder.__enter__()  # type: ignore[no-untyped-call]


def _deactivate(probe: _OpSink) -> None:
    recorder = _recorder()
    if probe not in recorder.active:
        return
    recorder.active.remove(probe)
    if not recorder.active:
        recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]
