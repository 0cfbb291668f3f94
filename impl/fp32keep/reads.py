"""What the source says about how a model reaches its kept modules: the fallback. Pure.

FSDP2 all-gathers a unit's parameters in the unit's forward pre-hook, and around the methods
registered with ``register_fsdp_forward_method``. Two patterns defeat that:

* a module whose ancestor reads its tensors directly (Voxtral's encoder adds
  ``self.embed_positions.weight`` to its input and never calls ``self.embed_positions``) is
  never all-gathered: the ancestor meets the sharded ``DTensor`` and the first forward fails with
  ``aten.add.Tensor got mixed torch.Tensor and DTensor``;
* a unit its ancestor runs through another method (Apertus 1.5 calls
  ``self.audio_tokenizer.encode(...)``) runs sharded unless that method is registered.

What a forward does is best observed (:func:`fp32keep.observe_parameter_use`, which the
contract runs on its unsharded reference); this module answers the same two questions from the
source alone, for a plain :func:`fp32keep.apply_fsdp2` that has no inputs to run. The source of
an ancestor is the source of every model class in its MRO (an inherited ``forward``, a helper
defined on a base class), not of its own class only:

* :func:`find_direct_read`: an attribute access ``NAME.TENSOR`` (``embed_positions.weight``),
  other than a metadata read (``.dtype``, ``.shape``, ...), or for a ``ParameterList`` or
  ``ParameterDict`` (no forward: always read) any use of ``.NAME`` (``self.scales[0]``), in an
  ancestor's source, while no ancestor's source calls ``NAME(...)``; or the module handed to a
  module-level function (``FUNC(self.NAME, ...)``, Bailing-Hybrid 5.25's
  ``causal_conv1d_forward(self.conv1d, ...)``, also when ``kernels`` has made that function a
  module passing its arguments on) whose own source reads ``PARAM.TENSOR`` of the
  parameter it arrives in and does not call it;
* :func:`called_methods`: ``NAME.METHOD(`` in an ancestor's source, for a ``METHOD`` the
  module's own model classes define, and only where that method's source (again through the
  MRO) reaches the module's parameters: a pure helper (Kyutai's ``get_encoded_length``, which
  computes a length from convolution strides) would otherwise make every call an all-gather of
  the whole unit (:mod:`fp32keep.source_use`).

* :func:`uses_from_outside`: for a unit fp32keep makes (:mod:`fp32keep.unit_reach`), each
  ``self.PATH.TENSOR`` and ``self.PATH(...)`` in the runtime methods of its ancestors outside it
  that reaches a parameter the unit manages (read from the syntax tree, not the text: a string
  such as Transformers' ``_tied_weights_keys`` is no read).

A read the source does not spell out (``getattr`` with a computed name, a function reached
through an attribute or handed the module on to another function, a class whose source is
unavailable) is not found; such a module is treated as called, as before.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fp32keep.errors import hidden_in_tracebacks
from fp32keep.source_use import METADATA_ATTRIBUTES, model_classes, model_methods, source_of
from fp32keep.source_use import method_uses_parameters as _method_uses_parameters

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

# Reads that work on a sharded DTensor as on a plain tensor: they never need the all-gather.
_METADATA = rf"(?!\s*\.\s*(?:{'|'.join(sorted(METADATA_ATTRIBUTES))})\b)"


@dataclass(frozen=True)
class DirectRead:
    """A kept module whose tensors an ancestor reads without calling the module.

    Attributes:
        module_fqn: the module read.
        reader: the class of the ancestor that reads it.
        expression: what is read, e.g. ``embed_positions.weight``.
        reader_fqn: the module whose class is ``reader`` (``""`` for the model itself).
        evidence: how the read was found: ``"source"`` (this module's scan of the ancestor's
            classes), the function it was read in (``"read in causal_conv1d_forward(), which
            it is handed to"``, also from the source) or where it was observed (``"observed in
            VoxtralEncoder.forward"``, :mod:`fp32keep.observe`).
    """

    module_fqn: str
    reader: str
    expression: str
    reader_fqn: str = ""
    evidence: str = "source"


def _mro_source(module: nn.Module) -> str:
    """The source of every model class in ``module``'s MRO, most derived first."""
    return "\n".join(source_of(cls) for cls in model_classes(type(module)))


def _attribute_and_ancestors(
    model: nn.Module, module_fqn: str
) -> tuple[str, list[tuple[str, nn.Module, str]]] | None:
    """The attribute name ``module_fqn`` is reached by, and its ancestors nearest first, each as
    ``(fqn, module, source of its classes)``; ``None`` for the root or a ``ModuleList`` entry (an
    entry is called by its parent's loop, which the source cannot tie to a name)."""
    if not module_fqn:
        return None
    *parents, name = module_fqn.split(".")
    if not name.isidentifier():
        return None
    ancestors = []
    for cut in range(len(parents), -1, -1):
        fqn = ".".join(parents[:cut])
        ancestor = model.get_submodule(fqn)
        ancestors.append((fqn, ancestor, _mro_source(ancestor)))
    return name, ancestors


def find_direct_read(model: nn.Module, module_fqn: str) -> DirectRead | None:
    """The ancestor whose source reads ``module_fqn``'s own tensors without calling it, if any.

    Only modules reached through an identifier attribute are judged
    (:func:`_attribute_and_ancestors`).
    """
    module = model.get_submodule(module_fqn)
    tensors = [n for n, _ in module.named_parameters(recurse=False)]
    tensors += [n for n, _ in module.named_buffers(recurse=False)]
    reached = _attribute_and_ancestors(model, module_fqn) if tensors else None
    if reached is None:
        return None
    name, ancestors = reached
    if isinstance(module, nn.ParameterList | nn.ParameterDict):
        # Read by indexing or iterating (``self.scales[0]``, ``for s in self.scales``): the
        # container itself is what the source names, other than where it is assigned (or
        # annotated: ``self.scales: nn.ParameterList = ...``).
        read = re.compile(rf"\.\s*{name}\b(?!\s*\(|\s*=(?!=)|\s*:)((?:\s*\[[^\]\n]*\])?)")
    else:
        tensor = "|".join(map(re.escape, tensors))
        read = re.compile(rf"\b{name}\s*(\.\s*(?:{tensor}))\b{_METADATA}")
    call = re.compile(rf"\b{name}\s*(?:\.\s*forward\s*)?\(")
    found: DirectRead | None = None
    for ancestor_fqn, ancestor, source in ancestors:
        if call.search(source):
            return None
        handed = _handed_use(ancestor, name, tensors)
        if handed is _CALLED:
            return None
        match = read.search(source)
        if found is not None:
            continue
        reader = type(ancestor).__name__
        if match is not None:
            expression = name + re.sub(r"\s+", "", match.group(1))
            found = DirectRead(module_fqn, reader, expression, ancestor_fqn)
        elif handed is not None:
            tensor, function = handed
            evidence = f"read in {function}(), which it is handed to"
            found = DirectRead(module_fqn, reader, f"{name}.{tensor}", ancestor_fqn, evidence)
    return found


_CALLED = ("", "")  # _handed_use: a function the module is handed to calls it


def _runtime_methods(source: str) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The methods of the class whose source is ``source`` that may run after sharding: all but
    construction and weight initialisation (``__init__``, ``_init_weights``, ...), where handing
    a module to a function (``tie(self.lm_head, self.embed_tokens)``) reads nothing FSDP2 gathers.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for klass in tree.body:
        if isinstance(klass, ast.ClassDef):
            for method in klass.body:
                if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) and not (
                    method.name == "__init__" or method.name.startswith("_init")
                ):
                    yield method


def _handoffs(ancestor: nn.Module, name: str) -> Iterator[tuple[Any, int | str]]:
    """Each ``FUNC(..., x.NAME, ...)`` in the runtime methods of ``ancestor``'s classes
    (:func:`_runtime_methods`) where ``FUNC`` is a plain name of the class's own module: the
    function (as its module holds it) and the position (``int``) or keyword (``str``) the module
    is passed at."""
    for cls in model_classes(type(ancestor)):
        source = source_of(cls)
        if name not in source:
            continue
        namespace = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
        for node in (node for method in _runtime_methods(source) for node in ast.walk(method)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            function = namespace.get(node.func.id)
            if function is None:
                continue
            for index, argument in enumerate(node.args):
                if _is_attribute(argument, name):
                    yield function, index
            for keyword in node.keywords:
                if keyword.arg is not None and _is_attribute(keyword.value, name):
                    yield function, keyword.arg


def _is_attribute(node: ast.expr, name: str) -> bool:
    """Whether ``node`` is ``x.NAME`` (``self.conv1d``)."""
    return (
        isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name)
    )


def _function_def(function: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of a plain function's definition (decorators unwrapped), else ``None``.

    A callable object that passes its arguments through to a function is read as that function
    (:func:`_pass_through_target`): ``kernels``' ``use_kernel_forward_from_hub`` turns a
    decorated function into such an ``nn.Module`` (Bailing-Hybrid 5.25's
    ``causal_conv1d_forward`` where ``kernels`` is installed).
    """
    function = inspect.unwrap(function)
    if not inspect.isfunction(function):
        target = _pass_through_target(function)
        return None if target is None else _function_def(target)
    return _parsed_definition(function)


def _parsed_definition(function: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of ``function``'s own definition (``None``: no source, not a def)."""
    source = source_of(function)
    try:
        tree = ast.parse(source) if source else None
    except SyntaxError:
        return None
    first = tree.body[0] if tree is not None and tree.body else None
    return first if isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _pass_through_target(callable_object: Any) -> Any | None:
    """The plain function a callable object hands its arguments to unchanged, if its call
    method (``forward`` for a module, else ``__call__``) is ``def M(self, *ARGS, **KWARGS)``
    calling a function it closes over as ``F(*ARGS, **KWARGS)``: positions and keywords then
    reach ``F`` as they were given (``None`` for any other shape: not followed)."""
    if inspect.isclass(callable_object) or inspect.isroutine(callable_object):
        return None  # a class constructs, a builtin has no source: nothing to follow
    method_name = "forward" if isinstance(callable_object, nn.Module) else "__call__"
    method = getattr(type(callable_object), method_name, None)
    if not inspect.isfunction(method) or not method.__closure__:
        return None
    definition = _parsed_definition(method)
    if definition is None:
        return None
    star, double_star = definition.args.vararg, definition.args.kwarg
    if star is None or double_star is None:
        return None
    closed_over = dict(zip(method.__code__.co_freevars, method.__closure__, strict=True))
    for node in ast.walk(definition):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in closed_over
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Starred)
            and _is_name(node.args[0].value, star.arg)
            and len(node.keywords) == 1
            and node.keywords[0].arg is None
            and _is_name(node.keywords[0].value, double_star.arg)
        ):
            target = closed_over[node.func.id].cell_contents
            return target if inspect.isfunction(inspect.unwrap(target)) else None
    return None


def _is_name(node: ast.expr, name: str) -> bool:
    """Whether ``node`` is the bare identifier ``name``."""
    return isinstance(node, ast.Name) and node.id == name


def _parameter(definition: ast.FunctionDef | ast.AsyncFunctionDef, at: int | str) -> str | None:
    """The name of the parameter an argument passed at ``at`` arrives in (``None``: ``*args``,
    ``**kwargs`` or no such parameter)."""
    arguments = definition.args
    if isinstance(at, int):
        positional = [*arguments.posonlyargs, *arguments.args]
        return positional[at].arg if at < len(positional) else None
    named = {a.arg for a in (*arguments.args, *arguments.kwonlyargs)}
    return at if at in named else None


def _handed_use(ancestor: nn.Module, name: str, tensors: list[str]) -> tuple[str, str] | None:
    """What the module-level functions ``ancestor`` hands its child ``name`` to do with it:
    :data:`_CALLED` when one calls it (``PARAM(...)``, ``PARAM.forward(...)``), else
    ``(tensor, function name)`` for the first one reading ``PARAM.TENSOR`` other than for
    metadata, else ``None``."""
    read: tuple[str, str] | None = None
    for function, at in _handoffs(ancestor, name):
        definition = _function_def(function)
        parameter = _parameter(definition, at) if definition is not None else None
        if definition is None or parameter is None:
            continue
        parents = {
            child: node for node in ast.walk(definition) for child in ast.iter_child_nodes(node)
        }
        for node in ast.walk(definition):
            if isinstance(node, ast.Call) and (
                _is_name(node.func, parameter)
                or (
                    isinstance(node.func, ast.Attribute)
                    and node.func.attr == "forward"
                    and _is_name(node.func.value, parameter)
                )
            ):
                return _CALLED
            if (
                read is None
                and isinstance(node, ast.Attribute)
                and node.attr in tensors
                and _is_name(node.value, parameter)
                and not _metadata_of(parents.get(node))
            ):
                read = (node.attr, definition.name)
    return read


def _metadata_of(parent: ast.AST | None) -> bool:
    """Whether the attribute whose parent node is ``parent`` is only read for its metadata."""
    return isinstance(parent, ast.Attribute) and parent.attr in METADATA_ATTRIBUTES


def called_methods(model: nn.Module, module_fqn: str) -> tuple[str, ...]:
    """The methods other than ``forward`` that an ancestor's source calls on ``module_fqn`` and
    that reach its parameters: the ones FSDP2 must gather the unit around.

    Found like :func:`find_direct_read`: ``NAME.METHOD(`` in the source of an ancestor's
    classes, for a ``METHOD`` the module's own model classes define
    (:func:`fp32keep.source_use.model_methods`), kept only where
    :func:`fp32keep.source_use.method_uses_parameters` finds a parameter behind it. Sorted.
    """
    module = model.get_submodule(module_fqn)
    own = model_methods(module)
    reached = _attribute_and_ancestors(model, module_fqn) if own else None
    if reached is None:
        return ()
    name, ancestors = reached
    call = re.compile(rf"\b{name}\s*\.\s*({'|'.join(map(re.escape, sorted(own)))})\s*\(")
    found = {match.group(1) for _, _, source in ancestors for match in call.finditer(source)}
    return tuple(sorted(method for method in found if _method_uses_parameters(module, method)))


def _self_chain(node: ast.expr) -> tuple[str, ...] | None:
    """``("a", "b", "c")`` for ``self.a.b.c``; ``None`` for anything else."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and names:
        return tuple(reversed(names))
    return None


#: Builtins that look at an object without computing with it: fine on a sharded DTensor.
_INERT_CALLS = frozenset({"isinstance", "type", "id", "hasattr", "getattr", "callable"})


def _inert(parent: ast.AST | None, node: ast.expr) -> bool:
    """Whether ``node`` is only looked at (``isinstance(self.wo.weight, Tensor)``,
    ``self.head.bias is None``), not computed with."""
    if isinstance(parent, ast.Call) and node in parent.args:
        return isinstance(parent.func, ast.Name) and parent.func.id in _INERT_CALLS
    return isinstance(parent, ast.Compare) and all(
        isinstance(op, ast.Is | ast.IsNot) for op in parent.ops
    )


_Use = tuple[str, tuple[str, ...], bool]  # (method, chain, called)


@functools.lru_cache(maxsize=512)
def _chain_uses(cls: type) -> tuple[_Use, ...]:
    """Each outermost ``self.A.B...`` in the runtime methods of ``cls``'s own source
    (:func:`_runtime_methods`): ``(method, ("A", "B", ...), whether it is called)``."""
    found: list[_Use] = []
    for method in _runtime_methods(source_of(cls)):
        parents = {child: node for node in ast.walk(method) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(method):
            parent = parents.get(node)
            if not isinstance(node, ast.Attribute) or isinstance(parent, ast.Attribute):
                continue  # not an attribute, or not the outermost part of its chain
            if isinstance(node.ctx, (ast.Store, ast.Del)) and not isinstance(parent, ast.AugAssign):
                continue  # assigned or deleted (`self.decoder.bias = ...`), not read; `+=` reads
            chain = _self_chain(node)
            if chain is None:
                continue
            called = isinstance(parent, ast.Call) and parent.func is node
            if not _inert(parent, node):
                found.append((method.name, chain, called))
    return tuple(found)


def _owned_below(fqn: str, owned: Mapping[str, Collection[str]]) -> list[str]:
    """The names of the parameters in ``owned`` that ``fqn`` or a module below it owns."""
    return sorted(
        f"{module}.{tensor}"
        for module, tensors in owned.items()
        if module == fqn or module.startswith(fqn + ".")
        for tensor in tensors
    )


def uses_from_outside(
    model: nn.Module, modules: Sequence[str], owned: Mapping[str, Collection[str]]
) -> list[tuple[str, DirectRead, bool]]:
    """What the source of the ancestors outside a unit does with the unit's parameters.

    ``modules`` are the unit's modules, ``owned`` maps each module owning parameters the unit
    manages to their attribute names. For every model class of every ancestor of ``modules``
    that lies outside the unit, each ``self.PATH.TENSOR`` in its runtime methods (not for
    metadata, ``isinstance``, ``is None``) naming one of those parameters is a read, and each
    ``self.PATH(...)`` calling a module inside the unit that is not itself one of its modules is
    a call of every such parameter at or below it (FSDP2 gathers nothing around it), and so is
    ``self.PATH.forward(...)`` of any module inside the unit, its own modules included (an
    explicit ``.forward`` skips the module's hooks, where FSDP2 all-gathers):
    ``(parameter name, read, called)``. Only the methods
    the ancestor's class resolves to are read (a base's ``forward`` a subclass overrides is not
    what runs), spelled through ``self`` only: a path through an index
    (``self.layers[0].weight``), ``getattr`` or a local name is not found.
    """

    def inside(fqn: str) -> bool:
        return any(fqn == m or fqn.startswith(m + ".") for m in modules)

    found: dict[str, tuple[str, DirectRead, bool]] = {}
    ancestors = {
        ".".join(fqn.split(".")[:cut])
        for fqn in modules
        if fqn
        for cut in range(fqn.count(".") + 1)
    }
    for ancestor_fqn in sorted(a for a in ancestors if not inside(a)):
        ancestor = model.get_submodule(ancestor_fqn)
        for cls in model_classes(type(ancestor)):
            for method, spelled, called in _chain_uses(cls):
                if inspect.getattr_static(type(ancestor), method, None) is not vars(cls).get(
                    method
                ):
                    continue  # overridden by a more derived class: not what runs
                # `self.PATH.forward(...)` runs the module at PATH but skips its hooks, FSDP2's
                # all-gather among them: a use of everything below PATH, even of a unit's module.
                bypass = called and len(spelled) > 1 and spelled[-1] == "forward"
                chain = spelled[:-1] if bypass else spelled
                where = f"{cls.__name__}.{method}()"
                for cut in range(1, len(chain) + 1):
                    path = ".".join(chain[:cut])
                    full = f"{ancestor_fqn}.{path}" if ancestor_fqn else path
                    module_fqn, _, tensor = full.rpartition(".")
                    after = chain[cut] if cut < len(chain) else None
                    if tensor in owned.get(module_fqn, ()) and after not in METADATA_ATTRIBUTES:
                        evidence = f"read in {where}"
                        read = DirectRead(module_fqn, cls.__name__, path, ancestor_fqn, evidence)
                        found.setdefault(full, (full, read, False))
                    elif cut == len(chain) and called and inside(full):
                        if full in modules and not bypass:
                            continue  # a call of the unit's own module: its hooks gather it
                        spelling = f"{path}.forward(...)" if bypass else f"{path}(...)"
                        evidence = f"called in {where}"
                        read = DirectRead(full, cls.__name__, spelling, ancestor_fqn, evidence)
                        for name in _owned_below(full, owned):
                            found.setdefault(name, (name, read, True))
    return list(found.values())
