"""Which modules are standard FSDP2 units: the caller's ``wrap`` targets, or by default the
classes named by the model's ``_no_split_modules``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

from torch import nn

from fp32keep.errors import Fp32KeepTypeError, Fp32KeepValueError, hidden_in_tracebacks
from fp32keep.reprs import clipped_repr

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

WrapTarget: TypeAlias = type[nn.Module] | str
WrapSpec: TypeAlias = Iterable[WrapTarget] | Callable[[nn.Module], bool]
"""Standard targets: module classes or class names, or a predicate ``(module) -> bool``."""


def default_wrap_classes(model: nn.Module) -> frozenset[str]:
    """Class names from every ``_no_split_modules`` declaration in the model."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            names.update(str(name) for name in declared)
    return frozenset(names)


def check_wrap(wrap: object) -> None:
    """Refuse a ``wrap`` of the wrong type, naming it and the fix, before anything is done.

    A bare string is refused, not taken as one class name: ``wrap="Block"`` used to become the
    class names ``B``, ``l``, ``o``, ``c``, ``k``; the list it stands for is one ``[...]`` away.
    """
    if wrap is None or isinstance(wrap, type) or callable(wrap):
        return
    if isinstance(wrap, str):
        raise Fp32KeepTypeError(
            f"wrap must be a list of module classes or class names, got the string {wrap!r}; "
            f"pass wrap=[{wrap!r}] for that one class"
        )
    if not isinstance(wrap, Iterable) or isinstance(wrap, Mapping | bytes):
        raise Fp32KeepTypeError(
            f"wrap must be a list of module classes or class names, or a predicate "
            f"callable(module) -> bool, got {type(wrap).__name__} {clipped_repr(wrap, 80)}"
        )


def wrap_predicate(model: nn.Module, wrap: WrapSpec | None) -> Callable[[nn.Module], bool]:
    """Whether a module is a standard wrap target under ``wrap`` (default: the model's
    ``_no_split_modules`` classes); a bad ``wrap`` is refused naming what is wrong."""
    check_wrap(wrap)
    if wrap is None:
        classes = default_wrap_classes(model)
        return lambda module: type(module).__name__ in classes
    if isinstance(wrap, type):
        wrap = [wrap]
    if callable(wrap):
        return wrap
    targets = list(wrap)
    types = tuple(t for t in targets if isinstance(t, type))
    names = {t for t in targets if isinstance(t, str)}
    bad = [t for t in targets if not isinstance(t, (type, str))]
    if bad:
        raise Fp32KeepTypeError(
            f"wrap must hold module classes or class names, got {bad!r}; pass a predicate "
            "callable(module) -> bool for anything else"
        )
    present = {type(module).__name__ for module in model.modules()}
    missing = sorted(name for name in names if name not in present)
    if missing:
        raise Fp32KeepValueError(
            f"wrap names class(es) {missing} but {type(model).__name__} has no such module; "
            f"module classes present include {sorted(present)[:12]}"
        )

    def predicate(module: nn.Module) -> bool:
        return isinstance(module, types) or type(module).__name__ in names

    return predicate
