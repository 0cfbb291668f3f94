"""A family as a zoo :class:`~pytest_fp32keep.check.zoo.ZooEntry`, and whether it builds.

:func:`family_entry` is cheap (imports the family's modeling code, builds nothing); the entry's
``build`` shrinks the picked class's default config (:mod:`.shrink`) and instantiates it
offline, on CPU, in FP32, from the zoo's seed. :func:`probe` is the "does it build" question the
command asks before any rank starts: it builds the model, makes its batch and runs one forward
and backward, unsharded, in FP32; whatever raises makes the family *not buildable*, with the
stage and the error as the reason, so one family never crashes a whole run.
"""

from __future__ import annotations

import re
from functools import cache, partial
from typing import Any, NamedTuple

import torch
from torch import nn

from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.check.families.discovery import (
    KEEP_ATTRIBUTES,
    FamilyError,
    declaring_classes,
    pick_class,
)
from pytest_fp32keep.check.families.overrides import OVERRIDES
from pytest_fp32keep.check.families.shrink import tiny_config
from pytest_fp32keep.check.zoo import ZOO, ZooEntry
from pytest_fp32keep.check.zoo.building import build_seeded

#: A shrunk model above this many parameters was not shrunk (a size field this module does not
#: know): not buildable, rather than a slow check.
MAX_PARAMETERS = 5_000_000
#: How much of an error message a "not buildable" reason keeps.
_REASON_CHARS = 160


class Probe(NamedTuple):
    """Whether a family builds: its entry (``None`` when it does not) or the reason."""

    entry: ZooEntry | None
    reason: str | None


def _model_class(family: str) -> type:
    classes = declaring_classes(family)
    if not classes:
        raise FamilyError(f"{family}: no model class declares a non-empty keep list")
    return pick_class(classes)


def build_family_model(family: str) -> nn.Module:
    """The family's picked class from its shrunk config, FP32, seeded, offline."""
    cls: Any = _model_class(family)
    config = tiny_config(cls.config_class, OVERRIDES.get(family, {}))
    model = build_seeded(cls, config)
    count = sum(param.numel() for param in model.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"{count:,} parameters after shrinking (more than {MAX_PARAMETERS:,}): a size field "
            "of its config is not in pytest_fp32keep.check.families.shrink.TINY"
        )
    return model


def _dtypes(cls: type) -> tuple[torch.dtype, ...]:
    """fp16 and bf16 for a strict list, fp16 for a regular one (5.1+ ``from_pretrained``)."""
    return (
        (torch.float16, torch.bfloat16)
        if getattr(cls, KEEP_ATTRIBUTES[1], None)
        else (torch.float16,)
    )


@cache
def family_entry(family: str) -> ZooEntry:
    """The family as a zoo entry (named after the family); builds nothing.

    ``expect_layout_error`` is the curated zoo's word where the zoo has the same class (a
    layout FSDP2 cannot hold, such as Rwkv's ``time_decay`` beside its projections); otherwise
    ``False``, so a refusal is reported as one, for the reader to judge.
    """
    cls = _model_class(family)
    name = cls.__name__
    curated = [entry for entry in ZOO.values() if entry.model_class == name]
    return ZooEntry(
        name=family,
        model_class=name,  # the zoo's availability check is not used: probe() is
        build=partial(build_family_model, family),
        make_batch=family_batch,
        dtypes=_dtypes(cls),
        expect_layout_error=any(entry.expect_layout_error for entry in curated),
        notes=f"{name} from its default config, shrunk automatically"
        + (" (with overrides)" if family in OVERRIDES else ""),
    )


def _reason(stage: str, error: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(error)).strip()
    if len(text) > _REASON_CHARS:
        text = text[: _REASON_CHARS - 3] + "..."
    return f"{stage}: {type(error).__name__}: {text}"


@cache
def probe(family: str) -> Probe:
    """Build ``family``, make its batch, run forward and backward once; never raises for it."""
    stage = "model class"
    try:
        entry = family_entry(family)
        stage = "build"
        model = entry.build()
        stage = "batch"
        batch = entry.make_batch(model, 0)
        stage = "forward"
        output = model(**batch)
        loss = getattr(output, "loss", None)
        if loss is None:  # the contract's default loss for a model without labels
            loss = output[0].float().mean()
        stage = "backward"
        loss.backward()
    except Exception as error:  # any failure of one family is that family's row
        return Probe(None, _reason(stage, error))
    return Probe(entry, None)
