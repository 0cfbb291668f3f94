"""Which Transformers model families declare keep lists, and which class of each to check.

A *family* is a folder under ``transformers/models`` (``llama``, ``t5``, ``voxtral``). Listing
the families reads file text only (a ``modeling_*.py`` that mentions ``_keep_in_fp32_modules``);
:func:`declaring_classes` then imports the family's modeling modules and keeps the
``PreTrainedModel`` subclasses defined there whose ``_keep_in_fp32_modules`` or
``_keep_in_fp32_modules_strict`` (class attributes, inherited included: that is what an instance
reads) is non-empty in the installed version.

Which class is checked (:func:`pick_class`): the one that exercises the most of the model, so
towers and heads are in the plan. In order: ``...ForConditionalGeneration`` (the whole
multimodal or seq2seq model), ``...ForCausalLM``, any other head (``...For...``: it computes
a loss from labels), the base ``...Model``, then any other declaring class; within a rank, a
class exported at the top of ``transformers`` first, then the shortest name (the family's own
rather than a variant's: ``T5ForConditionalGeneration`` before
``T5GemmaForConditionalGeneration``), then alphabetical, so the choice is stable.
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


class FamilyError(LookupError):
    """A family name the installed Transformers does not have (or that declares nothing)."""


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


@cache
def keep_families() -> tuple[str, ...]:
    """The families with a class that declares a non-empty keep list, sorted.

    Imports the modeling code of every family that mentions one (a few seconds): a mention
    may be a comment, or a list left empty (``_keep_in_fp32_modules_strict = []``).
    """
    return tuple(family for family in mentioning_families() if _declares(family))


def _declares(family: str) -> bool:
    try:
        return bool(declaring_classes(family))
    except Exception:  # cannot import (a missing extra): listed, and its probe says why
        return True


def check_family_names(names: list[str]) -> None:
    """Raise :class:`FamilyError` naming every unknown family and how to list the known ones.

    Imports only the named families' modeling code (the full list imports all of them).
    """
    folder = models_dir()
    mentioning = mentioning_families()
    why = []
    for name in names:
        if name not in mentioning and not (folder / name).is_dir():
            why.append(f"{name!r} (no folder {name} under {folder})")
        elif name not in mentioning or not _declares(name):
            why.append(f"{name!r} (declares no non-empty _keep_in_fp32_modules here)")
    if why:
        raise FamilyError(
            f"unknown --family {'; '.join(why)}: `fp32keep check --list --all-families` lists "
            "the families of the installed Transformers that declare a keep list"
        )


def _has_keep_list(cls: type) -> bool:
    return any(getattr(cls, attribute, None) for attribute in KEEP_ATTRIBUTES)


def declaring_classes(family: str) -> list[type]:
    """The family's ``PreTrainedModel`` subclasses with a non-empty keep list (imports it)."""
    from transformers import PreTrainedModel

    classes: dict[str, type] = {}
    for path in sorted((models_dir() / family).glob("modeling_*.py")):
        if path.stem.startswith(_OTHER_FRAMEWORKS):
            continue  # 4.x's TensorFlow and Flax ports: not torch modules
        module = importlib.import_module(f"transformers.models.{family}.{path.stem}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, PreTrainedModel)
                and value.__module__ == module.__name__
                and not value.__name__.endswith("PreTrainedModel")
                and _has_keep_list(value)
            ):
                classes[value.__name__] = value
    return list(classes.values())


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
