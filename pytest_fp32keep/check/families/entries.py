"""A family as a zoo :class:`~pytest_fp32keep.check.zoo.ZooEntry`, and whether it builds.

:func:`family_entry` is cheap (imports the family's modeling code, builds nothing); the entry's
``build`` shrinks the picked class's default config (:mod:`.shrink`) and instantiates it
offline, on CPU, in FP32, from the zoo's seed. :func:`probe` is the "does it build" question the
command asks before any rank starts: it builds the model, makes its batch and runs one forward
and backward, unsharded, in FP32; whatever raises makes the family *not buildable*, with the
stage and the error as the reason, so one family never crashes a whole run. A family whose
forward is random by design (:data:`.overrides.STOCHASTIC`) is *not runnable*, with why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache, partial
from typing import Any, NamedTuple

import torch
from torch import nn

from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.check.families.discovery import (
    FamilyError,
    candidate_families,
    class_order,
    is_candidate,
    mentioning_families,
    models_dir,
)
from pytest_fp32keep.check.families.overrides import OVERRIDES, SAME_LAYOUT_AS, STOCHASTIC
from pytest_fp32keep.check.families.refusals import REFUSALS, WRITTEN_IN
from pytest_fp32keep.check.families.shrink import tiny_config
from pytest_fp32keep.check.zoo import ZOO, ZooEntry
from pytest_fp32keep.check.zoo.building import build_seeded, seed_query_tokens
from pytest_fp32keep.contract.steps import logits_and_loss

#: A shrunk model above this many parameters was not shrunk (a size field this module does not
#: know): not buildable, rather than a slow check.
MAX_PARAMETERS = 5_000_000
#: How much of an error message a "not buildable" reason keeps.
_REASON_CHARS = 160
#: The dtypes at which a family's plan is resolved to tell whether it keeps a tensor.
LOW_PRECISION = (torch.float16, torch.bfloat16)


class Probe(NamedTuple):
    """Whether a family builds: its entry and no reason (``kind`` is ``buildable``), or no entry
    and the reason, which is never ``None`` then, and its kind: ``not buildable``, or ``not
    runnable`` (:data:`.overrides.STOCHASTIC`)."""

    entry: ZooEntry | None
    reason: str | None
    kind: str = "not buildable"


class Pick(NamedTuple):
    """The class of a family that is checked, and what its built model keeps.

    ``cls`` is ``None`` when no class of :func:`.discovery.class_order` keeps a tensor at fp16
    or bf16 in the installed Transformers (the family is not listed); ``kept`` maps each
    low-precision dtype to the names the plan keeps; ``passed_over`` says, per class tried
    before ``cls``, why it was not checked.
    """

    cls: type | None
    kept: Mapping[torch.dtype, frozenset[str]]
    passed_over: tuple[str, ...]


def build_class(cls: Any, family: str) -> nn.Module:
    """``cls`` from the family's shrunk default config, FP32, seeded, offline."""
    config = tiny_config(cls.config_class, OVERRIDES.get(family, {}))
    model = build_seeded(cls, config)
    seed_query_tokens(model)  # as a checkpoint holds them: Transformers' zeros give fp16 NaN
    count = sum(param.numel() for param in model.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"{count:,} parameters after shrinking (more than {MAX_PARAMETERS:,}): a size field "
            "of its config is not in pytest_fp32keep.check.families.shrink.TINY"
        )
    return model


@cache
def family_pick(family: str) -> Pick:
    """Build the classes of :func:`.discovery.class_order` in turn; the first whose model's
    plan (:func:`fp32keep.resolve_keep_plan`, fp16 and bf16) keeps a tensor is checked.

    The plan of the built model is the judge of whether a family keeps anything: a class
    attribute may be empty while 5.1+'s ``post_init`` merges a child's list (MusicGen), or
    non-empty while its entries match nothing of the built model (5.10's GlmAsr).
    When no class keeps a tensor but one failed to build, that first build error is raised:
    whether the family keeps something is then unknown, and the family is listed as not
    buildable with that reason rather than left out.
    """
    from fp32keep import resolve_keep_plan

    passed_over: list[str] = []
    errors: list[Exception] = []
    for cls in class_order(family):
        try:
            model = build_class(cls, family)
        except Exception as error:  # that class's row, or the next class
            errors.append(error)
            passed_over.append(f"{cls.__name__} does not build ({_reason('build', error)})")
            continue
        kept = {dtype: resolve_keep_plan(model, dtype).names for dtype in LOW_PRECISION}
        if any(kept.values()):
            return Pick(cls, kept, tuple(passed_over))
        passed_over.append(f"{cls.__name__} keeps nothing here")
    if errors:
        raise errors[0]
    return Pick(None, {}, tuple(passed_over))


def keeps(family: str) -> bool:
    """Whether the family's built model keeps a tensor at fp16 or bf16 (:func:`family_pick`);
    ``True`` as well when it cannot be built: then its probe says why."""
    try:
        return family_pick(family).cls is not None
    except Exception:  # cannot build (a missing extra, a config it cannot default)
        return True


def listed(family: str) -> bool:
    """Whether ``--all-families`` checks ``family``: a folder of the installed Transformers, a
    candidate (:func:`.discovery.is_candidate`) whose built model keeps a tensor
    (:func:`keeps`). Builds that family only."""
    return (models_dir() / family).is_dir() and is_candidate(family) and keeps(family)


@cache
def keep_families() -> tuple[str, ...]:
    """The listed families (:func:`listed`), sorted: builds every candidate's tiny model once
    (:func:`.discovery.candidate_families`, cached)."""
    return tuple(family for family in candidate_families() if listed(family))


def check_family_names(names: list[str]) -> None:
    """Raise :class:`FamilyError` naming every unknown family and how to list the known ones.

    Imports and builds only the named families (the full list builds all of them).
    """
    folder = models_dir()
    why = []
    for name in names:
        if not (folder / name).is_dir():
            why.append(f"{name!r} (not a model family of the installed Transformers{_near(name)})")
        elif not listed(name):
            why.append(f"{name!r} (its built model keeps nothing at fp16 or bf16 here)")
    if why:
        raise FamilyError(
            f"unknown --family {'; '.join(why)}; `fp32keep check --list --all-families` lists "
            "those it checks"
        )


def _near(name: str) -> str:
    """``; close names: ...`` for a mistyped family: the closest families whose code mentions a
    keep list (read as text, nothing built), else any model folder; ``""`` where none is close."""
    import difflib

    folders = sorted(path.name for path in models_dir().iterdir() if path.is_dir())
    for known in (mentioning_families(), folders):
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        if close:
            return "; close names: " + ", ".join(close)
    return ""


def _model_class(family: str) -> type:
    picked = family_pick(family)
    if picked.cls is None:
        raise FamilyError(f"{family}: no model class keeps a tensor at fp16 or bf16")
    return picked.cls


def build_family_model(family: str) -> nn.Module:
    """The family's picked class (:func:`family_pick`) from its shrunk config, FP32, seeded,
    offline."""
    return build_class(_model_class(family), family)


def curated_entry(family: str) -> ZooEntry | None:
    """The curated zoo entry whose written expectations are the family's: the entry of the
    same class (``instructblip``), or the one :data:`.overrides.SAME_LAYOUT_AS` names
    (``instructblipvideo``); ``None`` for any other family."""
    if family in SAME_LAYOUT_AS:
        return ZOO[SAME_LAYOUT_AS[family]]
    name = _model_class(family).__name__
    return next((entry for entry in ZOO.values() if entry.model_class == name), None)


@cache
def family_entry(family: str) -> ZooEntry:
    """The family as a zoo entry (named after the family); builds its picked class once.

    ``dtypes`` are those at which the built model's plan keeps a tensor. ``expect_layout_error``
    and ``expectations`` are the curated zoo's word (:func:`curated_entry`: a layout FSDP2
    cannot hold, such as Rwkv's ``time_decay`` beside its projections), else the family's
    written refusals (:data:`.refusals.REFUSALS`); otherwise none, so a refusal fails the check.
    """
    picked = family_pick(family)
    cls = _model_class(family)
    curated = curated_entry(family)
    name = cls.__name__
    passed = f" ({'; '.join(picked.passed_over)})" if picked.passed_over else ""
    expectations = curated.expectations if curated is not None else REFUSALS.get(family, ())
    return ZooEntry(
        name=family,
        model_class=name,  # the zoo's availability check is not used: probe() is
        build=partial(build_family_model, family),
        make_batch=family_batch,
        dtypes=tuple(dtype for dtype in LOW_PRECISION if picked.kept[dtype]),
        expect_layout_error=any(row.refusal is not None for row in expectations),
        expectations=expectations,
        notes=f"{name} from its default config, shrunk automatically"
        + (" (with overrides)" if family in OVERRIDES else "")
        + passed,
        written_in=curated.written_in if curated is not None else WRITTEN_IN,
    )


def _reason(stage: str, error: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(error)).strip()
    if len(text) > _REASON_CHARS:
        text = text[: _REASON_CHARS - 3] + "..."
    return f"{stage}: {type(error).__name__}: {text}"


@cache
def probe(family: str) -> Probe:
    """Build ``family``, make its batch, run forward and backward once; never raises for it."""
    stage = "build"  # family_entry builds the picked class once, for its plan
    try:
        entry = family_entry(family)
        model = entry.build()
        stage = "batch"
        batch = entry.make_batch(model, 0)
        stage = "forward"
        output = model(**batch)
        stage = "loss"  # the contract's own (the mean square of the logits without a loss)
        _, loss = logits_and_loss(output)
        stage = "backward"
        loss.backward()  # type: ignore[no-untyped-call]
    except Exception as error:  # any failure of one family is that family's row
        return Probe(None, _reason(stage, error))
    if family in STOCHASTIC:  # it runs, but no two runs agree: nothing to compare
        return Probe(None, f"random forward: {STOCHASTIC[family]}", "not runnable")
    return Probe(entry, None, "buildable")
