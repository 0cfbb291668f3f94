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


def find_direct_read(model: nn.Module, module_fqn: str) -> DirectRead | None:
    """The ancestor that reads ``module_fqn``'s own tensors without calling it, if any.

    Only modules reached through an identifier attribute are judged (a ``ModuleList`` entry is
    called by its parent's loop, which the source cannot tie to a name).
    """
    if not module_fqn:
        return None
    *parents, name = module_fqn.split(".")
    if not name.isidentifier():
        return None
    module = model.get_submodule(module_fqn)
    tensors = [n for n, _ in module.named_parameters(recurse=False)]
    tensors += [n for n, _ in module.named_buffers(recurse=False)]
    if not tensors:
        return None
    read = re.compile(rf"\b{name}\s*\.\s*({'|'.join(map(re.escape, tensors))})\b{_METADATA}")
    call = re.compile(rf"\b{name}\s*(?:\.\s*forward\s*)?\(")
    found: DirectRead | None = None
    for cut in range(len(parents), -1, -1):
        ancestor_fqn = ".".join(parents[:cut])
        ancestor = model.get_submodule(ancestor_fqn)
        source = _class_source(type(ancestor))
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
    tokenizers: it calls ``self.vision_tokenizer.encode(...)``, so as units of their own they
    would run sharded (``mixed torch.Tensor and DTensor``). Such a method must be registered with
    ``torch.distributed.fsdp.register_fsdp_forward_method`` on the unit. Found like
    :func:`find_direct_read`: ``NAME.METHOD(`` in the source of an ancestor's class, for a
    ``METHOD`` the module's own model classes define (:func:`_model_methods`). Sorted.
    """
    if not module_fqn:
        return ()
    *parents, name = module_fqn.split(".")
    if not name.isidentifier():
        return ()
    own = _model_methods(model.get_submodule(module_fqn))
    if not own:
        return ()
    call = re.compile(rf"\b{name}\s*\.\s*({'|'.join(map(re.escape, sorted(own)))})\s*\(")
    found: set[str] = set()
    for cut in range(len(parents), -1, -1):
        source = _class_source(type(model.get_submodule(".".join(parents[:cut]))))
        found.update(match.group(1) for match in call.finditer(source))
    return tuple(sorted(found))
