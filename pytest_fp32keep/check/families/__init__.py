"""Every Transformers model family that declares a keep list, from automatically shrunk configs.

The zoo (:mod:`pytest_fp32keep.check.zoo`) is the curated set; the families are the breadth.
For a family (a folder under ``transformers/models``), :mod:`.discovery` finds the classes that
declare ``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict`` in the installed version
and picks the one to check; :mod:`.shrink` shrinks its default config by field names (layers,
widths, heads, experts, vocabulary, every sub-config's towers; :mod:`.overrides` holds the few
values it cannot derive); :mod:`.batches` makes a batch that fits; :mod:`.entries` turns the
family into a zoo :class:`~pytest_fp32keep.check.zoo.ZooEntry`, so ``fp32keep check``'s rank
side runs it like any zoo model, and :func:`probe` says whether it builds.

Importing this package is cheap: ``transformers`` is imported by the functions only.
"""

from pytest_fp32keep.check.families.discovery import (
    FamilyError,
    check_family_names,
    declaring_classes,
    keep_families,
    pick_class,
)
from pytest_fp32keep.check.families.entries import (
    Probe,
    build_family_model,
    family_entry,
    probe,
)
from pytest_fp32keep.check.families.overrides import OVERRIDES

__all__ = [
    "OVERRIDES",
    "FamilyError",
    "Probe",
    "build_family_model",
    "check_family_names",
    "declaring_classes",
    "family_entry",
    "keep_families",
    "pick_class",
    "probe",
]
