"""fp32keep's own path through the same harness: the control every framework row is read against."""

from __future__ import annotations

from tests.frameworks.harness import Setup, on_zoo, passes_everywhere

SETUPS = (
    Setup(
        "fp32keep (control)",
        "pytest-fp32keep",
        "the contract's defaults (`fp32keep`'s cast, `apply_fsdp2`, loader) through the same "
        "harness: no row, so the other setups' rows are the frameworks' own",
        on_zoo,
        passes_everywhere(),
    ),
)
