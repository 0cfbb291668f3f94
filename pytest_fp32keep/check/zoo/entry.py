"""What a zoo entry is: how to build a model, how to feed it, what to expect from it."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One zoo model: how to build it, how to feed it, and what to expect from it.

    Attributes:
        name: Registry key, lower case (``"t5"``, ``"gpt_oss"``, ...).
        model_class: Name of the Transformers class ``build`` instantiates; the entry is
            unavailable when the installed Transformers does not export it.
        build: Returns a fresh FP32 model built from a tiny config with :data:`BUILD_SEED`
            (same weights on every call). Imports ``transformers`` lazily.
        make_batch: ``make_batch(model, seed)`` returns the keyword arguments of one
            forward pass (always with ``labels``, so the output carries a loss) on the
            model's device; ``seed`` is an ``int`` or a ``torch.Generator``. The same seed
            gives the same batch.
        dtypes: The low-precision dtypes under which the model's declarations keep
            something in a 5.1+ ``from_pretrained`` (regular list: fp16; strict list:
            fp16 and bf16). What the *installed* version keeps is the plan's business:
            5.0.0 applies the regular list under bf16 too, and a class may declare
            nothing in older versions (see ``notes``).
        expect_layout_error: ``True`` when FSDP2 cannot isolate the kept tensors as
            units of their own, so ``fp32keep.apply_fsdp2`` must raise
            ``KeepLayoutError`` naming them (under every dtype in ``dtypes``).
        min_transformers: Lowest Transformers version the entry is meant for, or
            ``None``; below it the entry is reported unavailable.
        notes: Why the entry is in the zoo, in one or two sentences.
    """

    name: str
    model_class: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module, int | torch.Generator], dict[str, torch.Tensor]]
    dtypes: tuple[torch.dtype, ...]
    expect_layout_error: bool = False
    min_transformers: str | None = None
    notes: str = ""

    def unavailable_reason(self) -> str | None:
        """Why the installed Transformers cannot build this entry, or ``None`` if it can."""
        from packaging.version import Version

        installed = transformers_version()
        if self.min_transformers is not None and Version(installed) < Version(
            self.min_transformers
        ):
            return (
                f"{self.model_class} needs transformers>={self.min_transformers}; "
                f"installed {installed}"
            )
        transformers = importlib.import_module("transformers")
        try:
            getattr(transformers, self.model_class)
        except AttributeError:
            return f"transformers {installed} has no {self.model_class}"
        except ImportError as exc:  # the class exists but needs a missing dependency
            return f"transformers {installed} cannot import {self.model_class}: {exc}"
        return None


class ZooAvailability(NamedTuple):
    """What the installed Transformers can build.

    Attributes:
        available: Entries that build, in registry order.
        unavailable: Entry name → reason, for the entries that do not.
    """

    available: Mapping[str, ZooEntry]
    unavailable: Mapping[str, str]


def transformers_version() -> str:
    """The installed Transformers version string (read from metadata, no import)."""
    return importlib.metadata.version("transformers")
