"""Which kept modules their parents read without calling: found in the parents' source. Pure.

FSDP2 all-gathers a unit's parameters in the unit's forward pre-hook. A module whose parent reads
its tensors directly (Voxtral's encoder adds ``self.embed_positions.weight`` to its input and never
calls ``self.embed_positions``) is never all-gathered: the parent meets the sharded ``DTensor`` and
the first forward fails with ``aten.add.Tensor got mixed torch.Tensor and DTensor``.

Whether a forward calls a module cannot be known from the module tree, and a probe forward would
need inputs that only the caller has. The source of the parents' classes says it for the pattern
Transformers uses: an attribute access ``NAME.TENSOR`` (``embed_positions.weight``), other than a
metadata read (``.dtype``, ``.shape``, ...), in the class of an ancestor, while no ancestor's class
calls ``NAME(...)``. A read the source does not spell out (``getattr`` with a computed name, a
free function, a class whose source is unavailable) is not found; such a module is treated as
called, as before.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn

# Reads that work on a sharded DTensor as on a plain tensor: they never need the all-gather.
_METADATA = r"(?!\s*\.\s*(?:dtype|shape|device|size|ndim|dim|numel|requires_grad|is_meta)\b)"


@dataclass(frozen=True)
class DirectRead:
    """A kept module whose tensors an ancestor reads without calling the module.

    Attributes:
        module_fqn: the module read.
        reader: the class of the ancestor whose source reads it.
        expression: what the source reads, e.g. ``embed_positions.weight``.
        reader_fqn: the module whose class is ``reader`` (``""`` for the model itself).
    """

    module_fqn: str
    reader: str
    expression: str
    reader_fqn: str = ""


_SOURCES: dict[type, str] = {}


def _class_source(cls: type) -> str:
    if cls not in _SOURCES:
        try:
            _SOURCES[cls] = inspect.getsource(cls)
        except (OSError, TypeError):  # built in a REPL, by type(), or from a .pyc only
            _SOURCES[cls] = ""
    return _SOURCES[cls]


def _attribute_and_ancestors(
    model: nn.Module, module_fqn: str
) -> tuple[str, list[tuple[str, nn.Module, str]]] | None:
    """The attribute name ``module_fqn`` is reached by, and its ancestors nearest first, each as
    ``(fqn, module, source of its class)``; ``None`` for the root or a ``ModuleList`` entry (an
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
        ancestors.append((fqn, ancestor, _class_source(type(ancestor))))
    return name, ancestors


def find_direct_read(model: nn.Module, module_fqn: str) -> DirectRead | None:
    """The ancestor that reads ``module_fqn``'s own tensors without calling it, if any.

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
    read = re.compile(rf"\b{name}\s*\.\s*({'|'.join(map(re.escape, tensors))})\b{_METADATA}")
    call = re.compile(rf"\b{name}\s*(?:\.\s*forward\s*)?\(")
    found: DirectRead | None = None
    for ancestor_fqn, ancestor, source in ancestors:
        if call.search(source):
            return None
        match = read.search(source)
        if match is not None and found is None:
            expression = f"{name}.{match.group(1)}"
            found = DirectRead(module_fqn, type(ancestor).__name__, expression, ancestor_fqn)
    return found


def _model_methods(module: nn.Module) -> set[str]:
    """The public methods ``module``'s own model classes define: not ``nn.Module``'s and not
    Transformers' generic mixins' (``.to(...)``, ``.float()``, ``.get_input_embeddings()``)."""
    methods: set[str] = set()
    for cls in type(module).__mro__:
        if cls is nn.Module:
            break
        origin = cls.__module__ or ""
        # torch's own classes (FSDP2's FSDP<Name> wrapper class, nn.ModuleDict) and
        # Transformers' mixins add no model method
        if origin.startswith("torch") or (
            origin.startswith("transformers.") and ".models." not in origin
        ):
            continue
        methods.update(
            attr
            for attr, value in vars(cls).items()
            if inspect.isfunction(value) and not attr.startswith("_") and attr != "forward"
        )
    return methods


def called_methods(model: nn.Module, module_fqn: str) -> tuple[str, ...]:
    """The methods other than ``forward`` that an ancestor's source calls on ``module_fqn``.

    FSDP2 all-gathers a unit around its ``forward`` only. Apertus 1.5 never calls its kept
    audio tokenizer: it calls ``self.audio_tokenizer.encode(...)``, so as a unit of its own it
    would run sharded (``mixed torch.Tensor and DTensor``). Such a method must be registered with
    ``torch.distributed.fsdp.register_fsdp_forward_method`` on the unit. Found like
    :func:`find_direct_read`: ``NAME.METHOD(`` in the source of an ancestor's class, for a
    ``METHOD`` the module's own model classes define (:func:`_model_methods`). Sorted.
    """
    own = _model_methods(model.get_submodule(module_fqn))
    reached = _attribute_and_ancestors(model, module_fqn) if own else None
    if reached is None:
        return ()
    name, ancestors = reached
    call = re.compile(rf"\b{name}\s*\.\s*({'|'.join(map(re.escape, sorted(own)))})\s*\(")
    found = {match.group(1) for _, _, source in ancestors for match in call.finditer(source)}
    return tuple(sorted(found))
