"""Comparing the activation boundaries of two runs: :func:`diff_boundaries`.

The diff of an unsharded reference against the same model under FSDP2, say, as
:class:`~.records.BoundaryMismatch` records (one differing or one-sided leaf each);
:func:`format_mismatches` in :mod:`.render` prints the result.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pytest_fp32keep.contract.probe.dtype_probe import DtypeProbe
from pytest_fp32keep.contract.probe.records import (
    BoundaryMismatch,
    BoundaryRecord,
    Direction,
)


def _boundaries_of(source: DtypeProbe | Iterable[BoundaryRecord]) -> list[BoundaryRecord]:
    if isinstance(source, DtypeProbe):
        return list(source.boundary_records)
    return list(source)


def diff_boundaries(
    reference: DtypeProbe | Iterable[BoundaryRecord],
    observed: DtypeProbe | Iterable[BoundaryRecord],
    *,
    modules: Iterable[str] | None = None,
) -> list[BoundaryMismatch]:
    """Compare the activation boundaries of two runs, e.g. unsharded reference vs FSDP2.

    Both runs must make the same forward calls in the same context (autocast or direct); FQNs
    are compared as they are (``fully_shard`` does not rename modules).

    Args:
        reference: the expected run (a probe or its boundary records).
        observed: the run under test.
        modules: FQNs to compare. By default every module both probes select (given records,
            every module either recorded), so a module probed on one side only is not a
            mismatch, but a probed module called fewer times on one side is.

    Returns:
        One :class:`BoundaryMismatch` per (module, call, direction, leaf path) whose dtype
        differs or that exists on one side only, in the reference's module order (given a
        probe) and call order; empty when the two runs agree.
    """
    expected_records = _boundaries_of(reference)
    observed_records = _boundaries_of(observed)
    if modules is not None:
        wanted = set([modules] if isinstance(modules, str) else modules)
    elif isinstance(reference, DtypeProbe) and isinstance(observed, DtypeProbe):
        wanted = set(reference.modules) & set(observed.modules)
    else:
        wanted = {r.fqn for r in expected_records} | {r.fqn for r in observed_records}

    def index(records: list[BoundaryRecord]) -> dict[tuple[str, int], BoundaryRecord]:
        return {(r.fqn, r.call): r for r in records if r.fqn in wanted}

    expected_by_call = index(expected_records)
    observed_by_call = index(observed_records)
    keys = list(expected_by_call) + [k for k in observed_by_call if k not in expected_by_call]
    if isinstance(reference, DtypeProbe):
        # Records are kept in return order (children first); report in module order instead.
        order = {fqn: position for position, fqn in enumerate(reference.modules)}
        keys.sort(key=lambda key: (order.get(key[0], len(order)), key[1]))
    mismatches: list[BoundaryMismatch] = []
    for fqn, call in keys:
        want = expected_by_call.get((fqn, call))
        got = observed_by_call.get((fqn, call))
        for direction in ("input", "output"):
            want_dtypes = _direction_dtypes(want, direction)
            got_dtypes = _direction_dtypes(got, direction)
            paths = list(want_dtypes) + [p for p in got_dtypes if p not in want_dtypes]
            for path in paths:
                if want_dtypes.get(path) != got_dtypes.get(path):
                    mismatches.append(
                        BoundaryMismatch(
                            fqn, call, direction, path, want_dtypes.get(path), got_dtypes.get(path)
                        )
                    )
    return mismatches


def _direction_dtypes(
    record: BoundaryRecord | None, direction: Direction
) -> dict[str, torch.dtype]:
    if record is None:
        return {}
    return record.input_dtypes if direction == "input" else record.output_dtypes
