"""Every Transformers model family whose model keeps a tensor, from automatically shrunk configs.

The zoo (:mod:`pytest_fp32keep.check.zoo`) is the curated set; the families are the breadth.
For a family (a folder under ``transformers/models``), :mod:`.discovery` says whether it may keep
a tensor (its code mentions ``_keep_in_fp32_modules``, or its default config holds such a
family's config) and in which order to try its classes; :func:`family_pick` builds them until
the plan of one keeps a tensor at fp16 or bf16, which is what lists the family;
:mod:`.shrink` shrinks its default config by field names (layers,
widths, heads, experts, vocabulary, every sub-config's towers; :mod:`.overrides` holds the few
values it cannot derive); :mod:`.batches` makes a batch that fits; :mod:`.entries` turns the
family into a zoo :class:`~pytest_fp32keep.check.zoo.ZooEntry`, so ``fp32keep check``'s rank
side runs it like any zoo model, and :func:`probe` says whether it builds.

Importing this package is cheap: ``transformers`` is imported by the functions only.
"""

from pytest_fp32keep.check.families.discovery import (
    FamilyError,
    candidate_families,
    declaring_classes,
    pick_class,
)
from pytest_fp32keep.check.families.entries import (
    Pick,
    Probe,
    build_family_model,
    check_family_names,
    curated_entry,
    family_entry,
    family_pick,
    keep_families,
    listed,
    probe,
)
from pytest_fp32keep.check.families.overrides import OVERRIDES

__all__ = [
    "OVERRIDES",
    "FamilyError",
    "Pick",
    "Probe",
    "build_family_model",
    "candidate_families",
    "check_family_names",
    "curated_entry",
    "declaring_classes",
    "family_entry",
    "family_pick",
    "keep_families",
    "listed",
    "pick_class",
    "probe",
]
