"""Reading a model's classes: their sources through the MRO, and whether a method reaches the
module's parameters. Pure; the fallback of :mod:`fp32keep.reads` when nothing was observed.

A model class is any class in a module's MRO below ``nn.Module`` that is not torch's own (FSDP2's
``FSDP<Name>`` class, ``nn.ModuleDict``) and not one of Transformers' generic mixins
(``PreTrainedModel``, ``GradientCheckpointingLayer``: their source is about every model, so
reading it would find every name). An inherited ``forward`` or a helper defined on a base class
is part of the model's source.

:func:`method_uses_parameters` decides from a method's syntax tree whether running it touches
the module's parameters, the question behind registering it with FSDP2: a method that does is a
collective once registered (it all-gathers the unit), one that does not (Kyutai's
``codec_model.get_encoded_length``, arithmetic on convolution strides) must not be.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from fp32keep._torch.modules import own_buffers, own_children, own_parameters
from fp32keep.errors import hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

#: Tensor attributes and methods that read metadata, which a sharded DTensor answers as the full
#: tensor would: using them never needs the all-gather.
METADATA_ATTRIBUTES = frozenset(
    {
        "device",
        "dim",
        "dtype",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_meta",
        "layout",
        "ndim",
        "nelement",
        "numel",
        "requires_grad",
        "shape",
        "size",
        "stride",
    }
)

_SOURCES: dict[Any, str] = {}
_UNRESOLVED = object()


def source_of(obj: Any) -> str:
    """The source of a class or function, ``""`` where Python has none (a REPL, ``type()``)."""
    if obj not in _SOURCES:
        try:
            _SOURCES[obj] = textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError):  # built in a REPL, by type(), or from a .pyc only
            _SOURCES[obj] = ""
    return _SOURCES[obj]


def model_classes(cls: type) -> Iterator[type]:
    """The model classes in ``cls``'s MRO, most derived first (see the module docstring)."""
    for base in cls.__mro__:
        if base is nn.Module:
            return
        origin = base.__module__ or ""
        if origin.startswith("torch") or (
            origin.startswith("transformers.") and ".models." not in origin
        ):
            continue
        yield base


def model_methods(module: nn.Module) -> set[str]:
    """The public methods ``module``'s model classes define, ``forward`` aside: not
    ``nn.Module``'s and not Transformers' generic mixins' (``.to(...)``, ``.float()``,
    ``.get_input_embeddings()``)."""
    return {
        name
        for cls in model_classes(type(module))
        for name, value in vars(cls).items()
        if inspect.isfunction(value) and not name.startswith("_") and name != "forward"
    }


def _defining_class(module: nn.Module, name: str, after: type | None = None) -> type | None:
    """The model class whose own ``name`` ``module.name`` resolves to (or, with ``after``, the
    next one in the MRO after ``after``, as ``super().name`` does)."""
    classes = list(model_classes(type(module)))
    if after is not None:
        classes = classes[classes.index(after) + 1 :] if after in classes else []
    for cls in classes:
        if name in vars(cls):
            return cls
    return None


def _function_tree(function: Callable[..., Any]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    source = source_of(inspect.unwrap(function))
    if not source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    first = tree.body[0] if tree.body else None
    return first if isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name`` without running code (no property, no ``__getattr__`` of anything but a
    module's registered children, parameters and buffers)."""
    if isinstance(obj, nn.Module):
        for registry in (own_parameters(obj), own_children(obj), own_buffers(obj)):
            if name in registry:
                return registry[name]
    return vars(obj).get(name, _UNRESOLVED) if hasattr(obj, "__dict__") else _UNRESOLVED


def _resolve(node: ast.expr, self_name: str, module: nn.Module) -> Any:
    """What an expression ``self.a.b`` names on ``module``; ``_UNRESOLVED`` for anything else."""
    if isinstance(node, ast.Name):
        return module if node.id == self_name else _UNRESOLVED
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, self_name, module)
        return _UNRESOLVED if owner is _UNRESOLVED else _attribute(owner, node.attr)
    return _UNRESOLVED


class _Reader:
    """One question, "does running this method touch the module's parameters?", answered by
    walking the method's syntax tree and, through ``self.x.method(...)`` and ``super()``, the
    trees of the methods it calls (each once)."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, type, str]] = set()

    def method(self, module: nn.Module, name: str, after: type | None = None) -> bool:
        cls = _defining_class(module, name, after)
        if cls is None:
            return False  # nn.Module's own (`.to`, `.get_submodule`): no model code runs
        key = (id(module), cls, name)
        if key in self._seen:
            return False
        self._seen.add(key)
        value = vars(cls)[name]
        if isinstance(value, (staticmethod, classmethod)):
            return False  # no instance: it cannot reach this module's parameters
        if not callable(value):
            return False
        tree = _function_tree(value)
        if tree is None or not tree.args.args:
            return True  # no source to read: registered, as before
        return self._tree(tree, tree.args.args[0].arg, module, cls)

    def _tree(
        self,
        tree: ast.FunctionDef | ast.AsyncFunctionDef,
        self_name: str,
        module: nn.Module,
        cls: type,
    ) -> bool:
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and self._call(node.func, self_name, module, cls):
                return True
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and self._value_read(node, parents.get(node), self_name, module)
            ):
                return True
        return False

    def _call(self, func: ast.expr, self_name: str, module: nn.Module, cls: type) -> bool:
        called = _resolve(func, self_name, module)
        if isinstance(called, nn.Module):  # self(...), self.child(...)
            return _has_parameters(called)
        if not isinstance(func, ast.Attribute):
            return False
        if (
            isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "super"
        ):
            return self.method(module, func.attr, after=cls)
        owner = _resolve(func.value, self_name, module)
        if isinstance(owner, nn.Parameter):
            return func.attr not in METADATA_ATTRIBUTES  # self.weight.float(), .t(), ...
        if isinstance(owner, nn.Module):
            if func.attr == "forward":
                return _has_parameters(owner)
            return self.method(owner, func.attr)
        return False

    @staticmethod
    def _value_read(
        node: ast.Attribute, parent: ast.AST | None, self_name: str, module: nn.Module
    ) -> bool:
        value = _resolve(node, self_name, module)
        if isinstance(value, nn.Parameter):
            return not (isinstance(parent, ast.Attribute) and parent.attr in METADATA_ATTRIBUTES)
        if isinstance(value, nn.Module) and value is not module:
            # The module itself handed on (iterated, indexed, passed): it will be run. Its
            # attributes and methods are judged where they are read.
            return not isinstance(parent, ast.Attribute) and _has_parameters(value)
        return False


def method_uses_parameters(module: nn.Module, name: str) -> bool:
    """Whether running ``module.name(...)`` can touch ``module``'s parameters, from the source.

    True where the method (found through the MRO), or a method it calls on ``self``, on a child
    (``self.encoder.encode(...)``) or through ``super()``, calls a module that has parameters,
    calls ``forward``, reads a parameter other than for metadata (``.dtype``, ``.shape``), or
    hands a module with parameters on (iterates, indexes or passes it); also where its source
    cannot be read (the old behaviour: registered). False for a pure helper, and for a name no
    model class defines.
    """
    return _Reader().method(module, name)
