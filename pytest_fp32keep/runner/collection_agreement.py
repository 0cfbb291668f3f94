"""Whether every rank of a launched world collected the same tests in the same order.

Under an external launcher every rank runs the session's tests in place and agrees on each
outcome after every phase, so a test one rank lacks would leave its peers waiting in the
agreement (or worse, agreeing about different tests). The ranks' lists of node ids are compared
before any test runs; :func:`differences` says how they differ, naming the tests. Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

#: At most this many node ids are named per difference; the rest are counted.
SHOWN: Final = 10


def differences(collected: Sequence[Sequence[str]]) -> str | None:
    """``None`` if every rank collected rank 0's list, else a message naming what differs.

    ``collected[r]`` is rank ``r``'s collected node ids in run order. Ranks with the same list
    are named together.
    """
    reference = list(collected[0])
    by_list: dict[tuple[str, ...], list[int]] = {}
    for rank, ids in enumerate(collected):
        if list(ids) != reference:
            by_list.setdefault(tuple(ids), []).append(rank)
    if not by_list:
        return None
    lines: list[str] = []
    for ids, ranks in by_list.items():
        lines += _one_difference(reference, list(ids), _ranks(ranks))
    return (
        "fsdp2: the ranks collected different tests, so none ran (under an external launcher "
        "every rank runs the same tests in the same order):\n"
        + "\n".join(f"  {line}" for line in lines)
        + "\nMake collection the same on every rank: no test defined, parametrized or "
        "deselected depending on the rank or the host, and ids that do not depend on the "
        "process (for example on object reprs)."
    )


def _one_difference(reference: list[str], ids: list[str], who: str) -> list[str]:
    known, mine = set(reference), set(ids)
    extra = [nodeid for nodeid in ids if nodeid not in known]
    missing = [nodeid for nodeid in reference if nodeid not in mine]
    lines = []
    if extra:
        lines.append(f"{who} collected, rank 0 did not: {_named(extra)}")
    if missing:
        lines.append(f"rank 0 collected, {who} did not: {_named(missing)}")
    if not lines:
        position = next(i for i, (a, b) in enumerate(zip(reference, ids, strict=True)) if a != b)
        lines.append(
            f"{who} collected the same tests in another order: at position {position + 1} "
            f"rank 0 has {reference[position]}, {who} {ids[position]}"
        )
    return lines


def _named(nodeids: list[str]) -> str:
    shown = ", ".join(nodeids[:SHOWN])
    more = len(nodeids) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
