"""``@pytest.mark.fsdp2(nproc=[1, 2, 4])``: one case of the test per world size.

At collection, a marker whose ``nproc`` is a list parametrizes its test over
:data:`~pytest_fp32keep.runner.options.WORLD_SIZE_PARAM` (``fsdp2_world_size``), one case per
listed size, ids ``nproc1``, ``nproc2`` ... (``-k nproc2`` selects them). The controller reads
each case's size from its parameter (:func:`~pytest_fp32keep.runner.options.item_settings`) and
dispatches it to ranks of that size; a case beyond ``--fsdp-max-nproc`` is skipped there.

The expansion depends on the marker alone, never on an option: the ranks collect the test files
again, with their own options, and must find the very node ids the parent sends them.
An invalid list is left unexpanded here; the controller reports it as that test's error, the way
it reports every bad marker argument (a collection error would stop the whole session).
"""

from __future__ import annotations

import pytest

from pytest_fp32keep.runner import options


def case_id(nproc: int) -> str:
    """The id part of the case that runs in ``nproc`` ranks."""
    return f"nproc{nproc}"


def parametrize(metafunc: pytest.Metafunc) -> None:
    """Expand a test whose closest ``fsdp2`` marker lists world sizes into one case per size."""
    mark = metafunc.definition.get_closest_marker(options.MARKER_NAME)
    listed = options.marker_nproc_list(mark) if mark is not None else None
    if listed is None:
        return
    try:
        sizes = options.validate_nproc_list(listed, f"@pytest.mark.{options.MARKER_NAME}")
    except options.MarkerError:
        return  # reported as the test's error when it runs, naming the test
    if options.WORLD_SIZE_PARAM not in metafunc.fixturenames:
        # A parameter the test function does not take: pytest checks parametrized names
        # against this list; the test's body still gets only the arguments it declares.
        metafunc.fixturenames.append(options.WORLD_SIZE_PARAM)
    metafunc.parametrize(
        options.WORLD_SIZE_PARAM, list(sizes), ids=[case_id(size) for size in sizes]
    )
