"""Framework adapters (examples/frameworks/) under the contract; only in ``nox -s frameworks``.

These tests need accelerate and Transformers >= 5.24, which the default test environment does
not have, and they run the contract on several zoo models in two ranks per framework: breadth that
the default suite's time budget does not allow. So the default ``pytest`` does not collect them at
all (``collect_ignore`` below, never a skip), and ``nox -s frameworks`` collects them by setting
``FP32KEEP_FRAMEWORKS=1``. With the variable set, a missing framework fails the import: nothing
here skips.

``FP32KEEP_FRAMEWORKS_RESULTS`` names a folder for one JSON record per case (rank 0 writes it),
from which ``python -m ci.frameworks_report`` renders ``docs/frameworks.md``.
"""

from __future__ import annotations

import os

ENABLED = os.environ.get("FP32KEEP_FRAMEWORKS") == "1"
"""Set by ``nox -s frameworks``; unset, this folder is not collected."""

collect_ignore_glob = [] if ENABLED else ["test_*.py"]
