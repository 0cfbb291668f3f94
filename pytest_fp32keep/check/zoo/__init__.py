"""The built-in zoo: real Transformers model classes built from tiny configs.

Every entry is a real ``PreTrainedModel`` subclass whose FP32-keep declarations
(``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict``) make it interesting for
the keep contract: what the declaration catches, under which dtype, with which layout. Nothing is
downloaded: each model is instantiated from a config of a few layers, hidden size 32 and
a vocabulary of 64, in FP32, from a fixed seed, and builds in a fraction of a second on
a CPU.

Importing this module is cheap: ``transformers`` is imported inside the builders and
availability checks only. The configs work unchanged on every Transformers version the
project supports (4.56 to the newest 5.x); where an argument or a class differs between
versions, :func:`~pytest_fp32keep.check.zoo.building.make_config` is the one place
that knows.

Use :data:`ZOO` for the full registry and :func:`available_entries` for what the
installed Transformers version can build, with a reason for everything it cannot.

The package: :mod:`.entry` (what an entry is), :mod:`.building` (configs and models from
version-neutral arguments), :mod:`.batches` (a batch that fits each kind of model),
:mod:`.models` (the tiny configs, the registry :data:`ZOO` and :func:`available_entries`).
"""

from pytest_fp32keep.check.zoo.entry import ZooAvailability, ZooEntry, transformers_version
from pytest_fp32keep.check.zoo.models import ZOO, available_entries

__all__ = [
    "ZOO",
    "ZooAvailability",
    "ZooEntry",
    "available_entries",
    "transformers_version",
]
