"""Every rank's verdict on one case of ``fp32keep check``, merged into the one row it reports.

Pure functions over the JSON-ready case dicts that :func:`pytest_fp32keep.check.ranks._run_case`
makes in each rank (gathered to rank 0 there): no torch, no I/O. The rule: a case passes only if
it passed on every rank. When the ranks agree (same outcome, same rows, same failing findings),
the row is rank 0's. When they disagree, the row is the worst rank's (error, then fail, then a
refusal that was not expected), its rows pass only where every rank's passed, each failing
finding names the ranks that saw it (``ranks``), and ``ranks_agree`` is false. Either way
``failed_ranks`` names the ranks that did not pass and ``rank_outcomes`` keeps what each rank
said (outcome, ok, failing checks, number of failures, message), for the JSON report.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

#: How bad an outcome is, to pick the rank whose account a disagreeing row shows.
_SEVERITY = {"error": 3, "fail": 2, "refused": 1, "pass": 0}


def _merged_status(per_rank: Sequence[Mapping[str, Any]], check: str) -> bool | None:
    """A check passes where it ran on some rank and failed on none; None: it ran on no rank."""
    values = [(case.get("status") or {}).get(check) for case in per_rank]
    ran = [value for value in values if value is not None]
    return all(ran) if ran else None


def _verdict(case: dict[str, Any]) -> tuple[Any, ...]:
    """What two ranks must share to agree (not the message: tracebacks differ in addresses)."""
    failures = tuple(
        (f["check"], f["subject"], f["expected"], f["observed"]) for f in case.get("failures", [])
    )
    status = tuple(sorted((case.get("status") or {}).items()))
    return (case["outcome"], case["ok"], status, failures)


def _rank_outcome(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    failed = sorted({f["check"] for f in case.get("failures", [])})
    return {
        "rank": rank,
        "outcome": case["outcome"],
        "ok": case["ok"],
        "failed_checks": failed,
        "failures": len(case.get("failures", [])),
        "message": case.get("message", ""),
    }


def ranks_label(ranks: Sequence[int]) -> str:
    """``"rank 1"`` or ``"ranks 0,2"``."""
    numbers = sorted(ranks)
    return f"{'rank' if len(numbers) == 1 else 'ranks'} {','.join(map(str, numbers))}"


def merge_case(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One case from every rank's account of it (``per_rank[r]`` is rank ``r``'s); see the
    module rules."""
    if not per_rank:
        raise ValueError("merge_case needs the case of at least one rank")
    outcomes = [_rank_outcome(rank, case) for rank, case in enumerate(per_rank)]
    if len({_verdict(case) for case in per_rank}) == 1:
        merged = copy.deepcopy(dict(per_rank[0]))
        merged["rank_outcomes"] = outcomes
        merged["ranks_agree"] = True
        merged["failed_ranks"] = [o["rank"] for o in outcomes if not o["ok"]]
        return merged
    worst = max(
        range(len(per_rank)),
        key=lambda r: (not per_rank[r]["ok"], _SEVERITY.get(per_rank[r]["outcome"], 0), -r),
    )
    merged = copy.deepcopy(dict(per_rank[worst]))
    merged["ok"] = all(case["ok"] for case in per_rank)
    shown = list(merged.get("status") or {})
    others = sorted({c for case in per_rank for c in (case.get("status") or {})} - set(shown))
    merged["status"] = {check: _merged_status(per_rank, check) for check in [*shown, *others]}
    seen: dict[tuple[str, ...], dict[str, Any]] = {}
    for rank, case in enumerate(per_rank):
        for finding in case.get("failures", []):
            key = (finding["check"], finding["subject"], finding["expected"], finding["observed"])
            entry = seen.setdefault(key, {**finding, "ranks": []})
            entry["ranks"].append(rank)
    merged["failures"] = list(seen.values())
    merged["failed_ranks"] = [o["rank"] for o in outcomes if not o["ok"]]
    merged["message"] = "\n".join(
        f"[{ranks_label([o['rank']])}] {str(o['message']).strip()}"
        for o in outcomes
        if not o["ok"] and o["message"]
    )
    merged["rank_outcomes"] = outcomes
    merged["ranks_agree"] = False
    return merged


def disagreement(case: dict[str, Any]) -> str:
    """``"rank 1: fail (parity); rank 0: pass"`` for a case the ranks disagree on, else ``""``."""
    if case.get("ranks_agree", True) or "rank_outcomes" not in case:
        return ""
    groups: dict[str, list[int]] = {}
    for outcome in case["rank_outcomes"]:
        how = outcome["outcome"]
        if outcome["failed_checks"]:
            how += f" ({', '.join(outcome['failed_checks'])})"
        groups.setdefault(how, []).append(outcome["rank"])
    if len(groups) == 1:
        return ""
    ordered = sorted(groups.items(), key=lambda item: (item[0].startswith("pass"), item[1]))
    return "; ".join(f"{ranks_label(ranks)}: {how}" for how, ranks in ordered)
