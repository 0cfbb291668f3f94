"""One check for every multi-rank refusal: each rank raises the same error, in time.

Test modules bind it with their bound (``functools.partial(refused_on_every_rank,
bound=LIBRARY_BOUND_S)``), so tests/test_errors_doc.py sees which bound a row's tests assert.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch.distributed as dist

from tests.error_bounds import note_elapsed

E = TypeVar("E", bound=BaseException)


def refused_on_every_rank(
    call: Callable[[], object],
    expected: type[E],
    match: str,
    *,
    bound: float,
    same_message: bool = True,
) -> E:
    """Run ``call`` on every rank; each must raise ``expected`` (matching ``match``) within
    ``bound`` seconds, with the same message unless ``same_message=False``. Each rank's time is
    recorded (``FP32KEEP_ERROR_TIMES``).

    A rank that does not raise fails here and never reaches the all-gather, so its peers stay
    stuck in it: the plugin then fails the test seconds later (no rank hangs unnoticed).
    """
    start = time.monotonic()
    with pytest.raises(expected, match=match) as error:
        call()
    elapsed = time.monotonic() - start
    seen: list[tuple[str, str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (type(error.value).__name__, str(error.value), elapsed))
    ranks = [entry for entry in seen if entry is not None]
    assert len(ranks) == len(seen), seen
    assert {kind for kind, _, _ in ranks} == {type(error.value).__name__}, seen
    assert len({message for _, message, _ in ranks}) == 1 or not same_message, seen
    slowest = max(seconds for _, _, seconds in ranks)
    assert slowest < bound, f"the slowest rank raised after {slowest:.1f} s (bound {bound} s)"
    if dist.get_rank() == 0:
        for index, (_, _, seconds) in enumerate(ranks):
            note_elapsed(seconds, f"rank {index}")
    return error.value
