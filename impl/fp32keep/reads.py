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
  ancestor's source, while no ancestor's source calls ``NAME(...)``;
* :func:`called_methods`: ``NAME.METHOD(`` in an ancestor's source, for a ``METHOD`` the
  module's own model classes define, and only where that method's source (again through the
  MRO) reaches the module's parameters: a pure helper (Kyutai's ``get_encoded_length``, which
  computes a length from convolution strides) would otherwise make every call an all-gather of
  the whole unit (:mod:`fp32keep.source_use`).

A read the source does not spell out (``getattr`` with a computed name, a free function, a class
whose source is unavailable) is not found; such a module is treated as called, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from fp32keep.source_use import METADATA_ATTRIBUTES, model_classes, model_methods, source_of
from fp32keep.source_use import method_uses_parameters as _method_uses_parameters

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
        evidence: how the read was found: ``"source"`` (this module's scan) or where it was
            observed (``"observed in VoxtralEncoder.forward"``, :mod:`fp32keep.observe`).
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
        match = read.search(source)
        if match is not None and found is None:
            expression = name + re.sub(r"\s+", "", match.group(1))
            found = DirectRead(module_fqn, type(ancestor).__name__, expression, ancestor_fqn)
    return found


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
