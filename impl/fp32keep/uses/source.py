"""What the source says about how a model reaches its parameters: the fallback, one rule. Pure.

FSDP2 all-gathers a unit's parameters around the unit's forward (its hooks) and around the
methods registered with ``register_fsdp_forward_method``, nowhere else. What a forward reaches
is observed (:func:`fp32keep.observe_parameter_use`, which :func:`fp32keep.apply_fsdp2` runs
on ``example_inputs=``); without inputs, this module reads one thing from the source:

**The rule.** In a module's ``forward`` (as its class resolves it, through the MRO's model
classes) and the methods that ``forward`` calls on ``self`` or through ``super()``, each
outermost attribute chain ``self.A.B.C`` of the syntax tree (Python's ``ast``: comments are
gone, a string is a constant, never a chain) is resolved against the module tree, from that
module down. It is

* a **read** of a parameter or buffer where it ends at one (``self.embed_positions.weight``),
  unless it goes on to metadata (``.dtype``, ``.shape``) or is only looked at
  (``isinstance(...)``, ``is None``); indexing or iterating a ``ParameterList`` or
  ``ParameterDict`` reads every parameter in it;
* a **call** of a module where it ends at one and is called (``self.encoder(x)``; also
  ``self.encoder.forward(x)``, which skips the module's hooks: :attr:`SourceUse.bypass`).

A child module's tensor that some ancestor reads while no ancestor calls the child is read, not
called (:func:`find_direct_read`); :func:`uses_from_outside` answers the same for the units
fp32keep makes. Everything else is *unseen*, and :func:`unseen_uses` names it for the warning
(:class:`fp32keep.SourceFallbackWarning`): a method other than ``forward`` called on a child
that has parameters (``self.codec_model.encode(...)``: whether it runs them, and so must be
gathered, only a run says), a child handed to a function (``conv1d_forward(self.conv1d, x)``),
a class with no source. Such a child is taken as called, and no method is gathered: no case per
model family lives here.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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

#: Builtins that look at an object without computing with it: fine on a sharded DTensor.
_INERT_CALLS = frozenset({"isinstance", "type", "id", "hasattr", "getattr", "callable"})


@dataclass(frozen=True)
class DirectRead:
    """A module whose tensors an ancestor reads without calling the module.

    Attributes:
        module_fqn: the module read.
        reader: the class of the ancestor that reads it.
        expression: what is read, relative to the reader, e.g. ``embed_positions.weight``.
        reader_fqn: the module whose class is ``reader`` (``""`` for the model itself).
        evidence: how the read was found: where the source spells it (``"read in
            VoxtralEncoder.forward()"``) or where it was observed (``"observed in
            VoxtralEncoder.forward"``, :mod:`fp32keep.uses.observe`).
    """

    module_fqn: str
    reader: str
    expression: str
    reader_fqn: str = ""
    evidence: str = "source"


_Role = Literal["call", "argument", "use"]
_Chain = tuple[str, tuple[str, ...], _Role, str]  # (method, ("A", "B"), role, as spelled)


@dataclass(frozen=True)
class SourceUse:
    """One resolved chain of a reader's source.

    ``kind``: ``"read"`` (``target`` a tensor, or a parameter container whose every tensor is
    read), ``"call"`` (``target`` a module; ``bypass`` when spelled ``.forward(...)``, which skips
    its hooks), ``"method"`` (``target`` a module, ``called`` the method other than ``forward``
    called on it) or ``"handed"`` (``target`` a module passed to a call). ``module``: the module
    ``target`` is or belongs to; ``method``: the reader's method (of class ``defined_in``) that
    spells it.
    """

    kind: Literal["read", "call", "method", "handed"]
    target: str
    module: str
    reader_fqn: str
    reader: str  # the reader's class
    defined_in: str  # the class whose method spells it
    method: str
    spelled: str  # relative to the reader, as written (``embed_positions.weight``)
    bypass: bool = False
    called: str = ""  # the method of a ``"method"`` use

    @property
    def where(self) -> str:
        """``Class.method()``: where the source spells it."""
        return f"{self.defined_in}.{self.method}()"


@functools.lru_cache(maxsize=1024)
def source_of(obj: object) -> str:
    """The source of a class or function, ``""`` where Python has none (a REPL, ``type()``)."""
    try:
        return textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def model_classes(cls: type) -> Iterator[type]:
    """The classes in ``cls``'s MRO below ``nn.Module`` that are the model's own: not torch's
    (``FSDP<Name>``, ``ModuleDict``), not Transformers' generic mixins (``PreTrainedModel``)."""
    for base in cls.__mro__:
        if base is nn.Module:
            return
        origin = base.__module__ or ""
        if origin.startswith("torch") or (
            origin.startswith("transformers.") and ".models." not in origin
        ):
            continue
        yield base


@dataclass(frozen=True)
class _Method:
    """One method's source, as the rule reads it: its chains, and the methods it calls on
    ``self`` (``self.helper(...)``) and through ``super()`` (``super().forward(...)``)."""

    chains: tuple[_Chain, ...]
    on_self: frozenset[str]
    on_super: frozenset[str]


@functools.lru_cache(maxsize=1024)
def _methods(cls: type) -> dict[str, _Method]:
    """The methods ``cls``'s own source defines (do not change the mapping: it is cached)."""
    try:
        tree = ast.parse(source_of(cls))
    except SyntaxError:
        return {}
    klass = tree.body[0] if tree.body and isinstance(tree.body[0], ast.ClassDef) else None
    found: dict[str, _Method] = {}
    for method in klass.body if klass is not None else ():
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            found[method.name] = _read_method(method)
    return found


def _read_method(method: ast.FunctionDef | ast.AsyncFunctionDef) -> _Method:
    chains: list[_Chain] = []
    on_self: set[str] = set()
    on_super: set[str] = set()
    parents = {child: node for node in ast.walk(method) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(method):
        if not isinstance(node, ast.Attribute):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                on_self.add(node.attr)
            elif isinstance(node.value, ast.Call) and _is_super(node.value):
                on_super.add(node.attr)
        chain = _self_chain(node)
        if chain is None or isinstance(parent, ast.Attribute) or _inert(parent, node):
            continue
        if isinstance(node.ctx, ast.Store | ast.Del) and not isinstance(parent, ast.AugAssign):
            continue  # assigned or deleted (`self.decoder.bias = ...`), not read
        shown: ast.expr = parent if isinstance(parent, ast.Subscript) else node
        chains.append((method.name, chain, _role(parent, node), ast.unparse(shown)[5:]))
    return _Method(tuple(chains), frozenset(on_self), frozenset(on_super))


def _is_super(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "super"


def _defining(kind: type, name: str, after: type | None = None) -> type | None:
    """The model class whose own ``name`` ``kind().name`` runs (after ``after`` in the MRO, as
    ``super().name`` from ``after`` does); ``None`` where no model class defines it."""
    classes = list(model_classes(kind))
    if after is not None:
        classes = classes[classes.index(after) + 1 :] if after in classes else []
    return next((cls for cls in classes if name in _methods(cls)), None)


def _forward_methods(kind: type) -> tuple[tuple[type, str], ...]:
    """The methods a forward of a ``kind`` module runs, as far as its source spells them:
    ``forward`` and, transitively, what it calls on ``self`` and through ``super()``."""
    start = _defining(kind, "forward")
    todo = [(start, "forward")] if start is not None else []
    seen: list[tuple[type, str]] = []
    while todo:
        cls, name = todo.pop()
        if (cls, name) in seen:
            continue
        seen.append((cls, name))
        method = _methods(cls)[name]
        for called in method.on_self:
            owner = _defining(kind, called)
            todo += [(owner, called)] if owner is not None else []
        for called in method.on_super:
            owner = _defining(kind, called, after=cls)
            todo += [(owner, called)] if owner is not None else []
    return tuple(seen)


def _self_chain(node: ast.expr) -> tuple[str, ...] | None:
    """``("a", "b")`` for ``self.a.b``; ``None`` for anything else."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and names:
        return tuple(reversed(names))
    return None


def _inert(parent: ast.AST | None, node: ast.expr) -> bool:
    """Whether ``node`` is only looked at (``isinstance(self.wo.weight, Tensor)``,
    ``self.head.bias is None``), not computed with."""
    if isinstance(parent, ast.Call) and node in parent.args:
        return isinstance(parent.func, ast.Name) and parent.func.id in _INERT_CALLS
    return isinstance(parent, ast.Compare) and all(
        isinstance(op, ast.Is | ast.IsNot) for op in parent.ops
    )


def _role(parent: ast.AST | None, node: ast.expr) -> _Role:
    if isinstance(parent, ast.Call):
        return "call" if parent.func is node else "argument"
    if isinstance(parent, ast.keyword):
        return "argument"
    return "use"


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _own_methods(module: nn.Module) -> set[str]:
    """The methods ``module``'s model classes define, ``forward`` and private ones aside."""
    return {
        name
        for cls in model_classes(type(module))
        for name, value in vars(cls).items()
        if inspect.isfunction(value) and not name.startswith("_") and name != "forward"
    }


_Resolved = tuple[str, str, str, str, int]  # (kind, target, module, method called, names spelled)


def _resolve(
    reader: nn.Module, reader_fqn: str, chain: tuple[str, ...], role: _Role
) -> _Resolved | None:
    """What one chain of ``reader``'s source uses, ``None`` where the rule says nothing (the
    reader's own tensors, metadata, an attribute that is no tensor and no module)."""
    module, fqn = reader, reader_fqn
    for index, name in enumerate(chain):
        after = chain[index + 1] if index + 1 < len(chain) else None
        tensors = {**own_buffers(module), **own_parameters(module)}
        if name in tensors:
            if module is reader or after in METADATA_ATTRIBUTES or tensors[name] is None:
                return None
            return "read", f"{fqn}.{name}" if fqn else name, fqn, "", index + 1
        child = own_children(module).get(name)
        if child is None:
            if module is reader or after is not None or role != "call":
                return None
            if name == "forward":
                return "call", fqn, fqn, "forward", len(chain)
            if name in _own_methods(module) and _has_parameters(module):
                return "method", fqn, fqn, name, len(chain)
            return None
        module, fqn = child, f"{fqn}.{name}" if fqn else name
    if role == "call":
        return "call", fqn, fqn, "", len(chain)
    if isinstance(module, nn.ParameterList | nn.ParameterDict):
        return "read", fqn, fqn, "", 0  # as spelled, with its index (`gains[self.key]`)
    if role == "argument" and _has_parameters(module):
        return "handed", fqn, fqn, "", len(chain)
    return None


def uses_in(model: nn.Module, reader_fqn: str) -> list[SourceUse]:
    """What the source of the module at ``reader_fqn`` does with the modules below it."""
    reader = model.get_submodule(reader_fqn)
    found: list[SourceUse] = []
    for cls, name in _forward_methods(type(reader)):
        for method, chain, role, spelled in _methods(cls)[name].chains:
            resolved = _resolve(reader, reader_fqn, chain, role)
            if resolved is None:
                continue
            kind, target, module, called, names = resolved
            found.append(
                SourceUse(
                    kind,  # type: ignore[arg-type]
                    target,
                    module,
                    reader_fqn,
                    type(reader).__name__,
                    cls.__name__,
                    method,
                    ".".join(chain[:names]) if names else spelled,
                    bypass=called == "forward",
                    called="" if called == "forward" else called,
                )
            )
    return found


def _ancestors(fqn: str) -> list[str]:
    """The fqns above ``fqn``, nearest first, the root (``""``) last."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[:cut]) for cut in range(len(parts) - 1, -1, -1)]


def _below(fqn: str, root: str) -> bool:
    return not root or fqn == root or fqn.startswith(root + ".")


def find_direct_read(model: nn.Module, module_fqn: str) -> DirectRead | None:
    """The nearest ancestor whose source reads ``module_fqn``'s own tensors (or, for a parameter
    container, the container) while no ancestor calls ``module_fqn`` or hands it on; else
    ``None``."""
    uses = [use for fqn in _ancestors(module_fqn) for use in uses_in(model, fqn)]
    if any(use.kind in ("call", "handed") and use.target == module_fqn for use in uses):
        return None
    for use in uses:
        if use.kind == "read" and use.module == module_fqn:
            return DirectRead(module_fqn, use.reader, use.spelled, use.reader_fqn)
    return None


def uses_from_outside(
    model: nn.Module, modules: Sequence[str], owned: Mapping[str, Collection[str]]
) -> list[tuple[str, DirectRead, bool]]:
    """What the source of the ancestors outside a unit does with the unit's parameters.

    ``modules`` are the unit's modules, ``owned`` maps each module owning parameters the unit
    manages to their attribute names. A read of one of those parameters is ``(name, read,
    False)``; a call of a module inside the unit that is not one of ``modules`` (or any
    ``.forward(...)`` of a module inside it, which skips FSDP2's hooks) is ``(name, read, True)``
    for every such parameter at or below it.
    """
    names = sorted(f"{m}.{t}" if m else t for m, ts in owned.items() for t in ts)
    above = {ancestor for fqn in modules for ancestor in _ancestors(fqn)}
    found: dict[str, tuple[str, DirectRead, bool]] = {}
    for reader_fqn in sorted(a for a in above if not _inside(a, modules)):
        for use in uses_in(model, reader_fqn):
            if use.kind not in ("read", "call") or not _inside(use.target, modules):
                continue
            if use.kind == "call" and use.target in modules and not use.bypass:
                continue  # a call of the unit's own module: its hooks gather it
            called = use.kind == "call"
            spelled = f"{use.spelled}(...)" if called else use.spelled
            evidence = f"{'called' if called else 'read'} in {use.where}"
            read = DirectRead(use.module, use.defined_in, spelled, reader_fqn, evidence)
            for name in names:
                if _below(name, use.target):
                    found.setdefault(name, (name, read, called))
    return list(found.values())


def _inside(fqn: str, modules: Collection[str]) -> bool:
    return any(_below(fqn, m) for m in modules)


def unseen_uses(model: nn.Module, units: Collection[str] | None = None) -> list[str]:
    """What the rule cannot judge in the forward of ``model``'s modules, one line per spelling
    and class: a method other than ``forward`` called on a child with parameters, a child handed
    to a function (a ``ModuleList`` or ``ModuleDict`` aside: its entries are called), a model
    class defining methods without source (one made by ``type()`` with attributes only reads
    as its bases). With ``units`` (the modules of a layout's units), only the uses of
    those modules: where a method runs sharded, or a module handed on is a unit of its own."""
    lines: dict[str, None] = {}
    for fqn, module in model.named_modules():
        for cls in model_classes(type(module)):
            defines = any(inspect.isfunction(value) for value in vars(cls).values())
            if defines and not source_of(cls):  # methods the rule cannot read
                lines.setdefault(f"{cls.__name__}: no source to read", None)
        for use in uses_in(model, fqn):
            if units is not None and use.target not in units:
                continue
            at = f"{use.where}: self.{use.spelled}"
            if use.kind == "method":
                lines.setdefault(f"{at}(...), a method other than forward", None)
            elif use.kind == "handed" and not isinstance(
                model.get_submodule(use.target), nn.ModuleList | nn.ModuleDict
            ):
                lines.setdefault(f"{at} handed to a function", None)
    return list(lines)
