"""``python -m pytest_fp32keep.check`` is the ``fp32keep`` console script."""

from pytest_fp32keep.check.cli import main

raise SystemExit(main())
