"""Which Transformers model families may keep a tensor, and the order their classes are tried.

A *family* is a folder under ``transformers/models`` (``llama``, ``t5``, ``voxtral``). Whether a
family keeps a tensor is decided by the plan of its built model
(:func:`pytest_fp32keep.check.families.entries.family_pick`); this module only says which
families are worth building (:func:`candidate_families`), cheaply, and which of a family's
classes to build first (:func:`class_order`).

A family is a *candidate* when

- its own modeling code mentions ``_keep_in_fp32_modules`` (:func:`mentioning_families`: reads
  file text, no import), or
- one of its default configs holds, at any depth, a config that a declaring class is built
  from (:func:`config_may_keep`: MusicGen's T5 text encoder, Kimi-K2.5's DeepSeek-V3 text
  model). Such a family declares nothing in its own files, yet its built model holds a
  declaring model, whose lists 5.1+'s ``post_init`` merges into the whole model's. The scan
  imports every family's configuration module and builds its default configs (seconds, no
  weights).

Which class is checked: the one that exercises the most of the model, so towers and heads are in
the plan (:func:`pick_class`). In order: ``...ForConditionalGeneration`` (the whole
multimodal or seq2seq model), ``...ForCausalLM``, any other head (``...For...``: it computes
a loss from labels), the base ``...Model``, then any other class; within a rank, a
class exported at the top of ``transformers`` first, then the shortest name (the family's own
rather than a variant's: ``T5ForConditionalGeneration`` before
``T5GemmaForConditionalGeneration``), then alphabetical, so the choice is stable.
:func:`class_order` tries the pick among all the family's model classes first (the whole
model, declaring or not), then the pick among the classes that declare a non-empty list
themselves (4.x does not merge a child's lists: there the whole model of a multimodal family
may keep nothing while its text model does).
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

KEEP_ATTRIBUTES = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
#: Modeling files of other frameworks (Transformers 4.x ships ``modeling_tf_t5.py`` and
#: ``modeling_flax_t5.py`` beside ``modeling_t5.py``).
_OTHER_FRAMEWORKS = ("modeling_tf_", "modeling_flax_")
_RANKED_SUFFIXES = ("ForConditionalGeneration", "ForCausalLM", "For", "Model")
_MODELS_PACKAGE = "transformers.models."


class FamilyError(LookupError):
    """A family name the installed Transformers does not have (or whose model keeps nothing)."""


def models_dir() -> Path:
    """``transformers/models`` of the installed Transformers, found without importing it."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise FamilyError("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


@cache
def mentioning_families() -> tuple[str, ...]:
    """Every family whose modeling code mentions a keep list, sorted (reads text, no import)."""
    found = set()
    for path in models_dir().glob("*/modeling_*.py"):
        if path.stem.startswith(_OTHER_FRAMEWORKS):
            continue
        if "_keep_in_fp32_modules" in path.read_text(encoding="utf-8", errors="replace"):
            found.add(path.parent.name)
    return tuple(sorted(found))


def _family_of(cls: type) -> str | None:
    """The family a class is defined in (``transformers.models.t5.configuration_t5`` -> t5)."""
    module = cls.__module__
    if not module.startswith(_MODELS_PACKAGE):
        return None
    return module.removeprefix(_MODELS_PACKAGE).split(".")[0]


def _defined_in(family: str, prefix: str, base: type) -> list[type]:
    """The subclasses of ``base`` defined in the family's ``PREFIX*.py`` modules (imports them)."""
    found: dict[str, type] = {}
    for path in sorted((models_dir() / family).glob(f"{prefix}*.py")):
        if path.stem.startswith(_OTHER_FRAMEWORKS):
            continue  # 4.x's TensorFlow and Flax ports: not torch modules
        module = importlib.import_module(f"{_MODELS_PACKAGE}{family}.{path.stem}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, base)
                and value.__module__ == (module.__name__)
            ):
                found[value.__name__] = value
    return list(found.values())


def config_classes(family: str) -> list[type]:
    """The config classes of the family's configuration modules (imports them)."""
    from transformers import PretrainedConfig

    return _defined_in(family, "configuration_", PretrainedConfig)


@cache
def held_config_classes(config_class: type) -> frozenset[type]:
    """The classes of the configs that ``config_class``'s default config holds, at any depth.

    The default config is the one its tiny model is shrunk from
    (:func:`pytest_fp32keep.check.families.shrink.default_config`); a class that cannot build
    one (a generic container such as ``EncoderDecoderConfig``, which has no default sub-configs,
    or a missing extra) holds nothing.
    """
    from transformers import PretrainedConfig

    from pytest_fp32keep.check.families.shrink import default_config

    try:
        config = default_config(config_class)
    except Exception:
        return frozenset()
    found: set[type] = set()
    stack, seen = [config], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for value in vars(current).values():
            if isinstance(value, PretrainedConfig):
                found.add(type(value))
                stack.append(value)
    found.discard(config_class)
    return frozenset(found)


@cache
def config_may_keep(config_class: type) -> bool:
    """Whether a model built from ``config_class``'s default config may keep a tensor: a class
    of its family whose own keep list is non-empty is built from it (``T5Config``:
    ``T5EncoderModel``), or it holds such a config (``MusicgenConfig`` holds a ``T5Config``).

    A config of a declaring family that no declaring class is built from does not count
    (``Blip2QFormerConfig``: ``Blip2QFormerModel`` declares nothing, so Granite Speech's
    Q-Former keeps nothing).
    """
    family = _family_of(config_class)
    if family in mentioning_families() and any(
        getattr(cls, "config_class", None) is config_class for cls in declaring_classes(family)
    ):
        return True
    return any(config_may_keep(held) for held in held_config_classes(config_class))


def is_candidate(family: str) -> bool:
    """Whether ``family``'s own code mentions a keep list, or a default config of the family
    holds one a declaring class is built from (:func:`config_may_keep`)."""
    if family in mentioning_families():
        return True
    try:
        classes = config_classes(family)
    except Exception:  # a configuration module that cannot be imported (a missing extra)
        return False
    return any(
        config_may_keep(held)
        for config_class in classes
        for held in held_config_classes(config_class)
    )


@cache
def candidate_families() -> tuple[str, ...]:
    """Every family that may keep a tensor (:func:`is_candidate`), sorted; the plan of each
    one's built model says whether it does."""
    folders = sorted(path.parent.name for path in models_dir().glob("*/configuration_*.py"))
    return tuple(
        family
        for family in dict.fromkeys([*mentioning_families(), *folders])
        if is_candidate(family)
    )


def _has_keep_list(cls: type) -> bool:
    return any(getattr(cls, attribute, None) for attribute in KEEP_ATTRIBUTES)


def model_classes(family: str) -> list[type]:
    """The family's ``PreTrainedModel`` subclasses, the ``...PreTrainedModel`` bases left out
    (imports its modeling code)."""
    from transformers import PreTrainedModel

    return [
        cls
        for cls in _defined_in(family, "modeling_", PreTrainedModel)
        if not cls.__name__.endswith("PreTrainedModel")
    ]


def declaring_classes(family: str) -> list[type]:
    """The family's model classes with a non-empty keep list of their own (class attributes,
    inherited included: that is what an instance reads before 5.1+'s ``post_init`` merges)."""
    return [cls for cls in model_classes(family) if _has_keep_list(cls)]


def class_order(family: str) -> list[type]:
    """The classes to build, in order, until one keeps a tensor (see the module docstring)."""
    order = [
        pick_class(classes)
        for classes in (model_classes(family), declaring_classes(family))
        if classes
    ]
    return list(dict.fromkeys(order))


def _rank(cls: type, exported: Any) -> tuple[int, int, int, str]:
    name = cls.__name__
    suffix = next(
        (
            index
            for index, end in enumerate(_RANKED_SUFFIXES)
            if name.endswith(end) or (end == "For" and end in name)
        ),
        len(_RANKED_SUFFIXES),
    )
    return (suffix, 0 if hasattr(exported, name) else 1, len(name), name)


def pick_class(classes: list[type]) -> type:
    """The class to check among ``classes`` (see the module docstring for the order)."""
    transformers = importlib.import_module("transformers")
    return min(classes, key=lambda cls: _rank(cls, transformers))
