"""Deterministic algorithms around the contract's runs, and what torch said it cannot make so.

Bit-identical parity compares runs of the same arithmetic; it assumes that the same kernels on
the same inputs give the same bits. On CUDA some do not (``index_add_``, ``scatter_add_`` and
the embedding backward use atomics; cuBLAS picks a reduction split by workspace), so every
forward and backward the contract runs (the reference, the implementation under test, the
parity control) runs inside :func:`deterministic`: ``torch.use_deterministic_algorithms(True,
warn_only=True)``, the caller's setting restored after. ``warn_only``: an operator torch has no
deterministic implementation of warns instead of raising (the contract judges precision, it must
not crash a model for using one), and :func:`deterministic` records those warnings as
*alerts*: what the run could not make deterministic, observed, not guessed. Every other warning
is re-issued unchanged after the block.

cuBLAS is deterministic only with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) in the
environment before cuBLAS starts, which no code inside a running process can arrange after the
fact; :func:`cublas_alert` reports a CUDA run without it, and ``fp32keep check`` sets it in each
rank before CUDA starts (``check/ranks.py``). Where a run is not known to be deterministic
(an alert on any rank, or any CUDA run: torch's flag covers neither NCCL's reductions nor kernels
outside aten), the parity control runs twice and each gradient's bound widens by the spread of
its two runs (:func:`second_run_reason`, ``docs/contract.md``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, MutableSequence, Sequence

import torch

__all__ = [
    "CUBLAS_DETERMINISTIC_CONFIGS",
    "alerted_operator",
    "cublas_alert",
    "deterministic",
    "second_run_reason",
]

CUBLAS_DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")
"""The ``CUBLAS_WORKSPACE_CONFIG`` values that make cuBLAS deterministic (torch's docs)."""

_NO_DETERMINISTIC = " does not have a deterministic implementation"
_CUBLAS = "uses CuBLAS"

_REISSUED: dict[str | tuple[str, type[Warning], int], int] = {}
"""The warning registry re-issued warnings share: a ``default`` filter shows each once per
location, as it would have without the contract in between."""


def alerted_operator(message: str) -> str | None:
    """The operator a torch non-determinism alert names (``"put_"``), or ``None`` when
    ``message`` is no such alert."""
    if _NO_DETERMINISTIC in message:
        return message.split(_NO_DETERMINISTIC, 1)[0].strip() or "an operator"
    if _CUBLAS in message:
        return "cuBLAS (CUBLAS_WORKSPACE_CONFIG unset)"
    return None


def cublas_alert(device: torch.device) -> str | None:
    """What a run on ``device`` cannot make deterministic because of the environment: cuBLAS
    on CUDA without a deterministic ``CUBLAS_WORKSPACE_CONFIG`` (``None`` otherwise)."""
    if device.type != "cuda":
        return None
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config in CUBLAS_DETERMINISTIC_CONFIGS:
        return None
    return f"cuBLAS (CUBLAS_WORKSPACE_CONFIG={config!r}, not :4096:8 or :16:8)"


@contextlib.contextmanager
def deterministic(alerts: MutableSequence[str]) -> Iterator[None]:
    """Run the block with torch's deterministic algorithms on (``warn_only=True``), appending
    to ``alerts`` each operator torch warned it has no deterministic implementation of.

    The caller's ``torch.use_deterministic_algorithms`` setting (mode and ``warn_only``) is
    restored on exit, crash or not; warnings that are not such alerts are re-issued after the
    block through the caller's filters.
    """
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            torch.use_deterministic_algorithms(True, warn_only=True)
            try:
                yield
            finally:
                torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
                caught = list(recorded)
    finally:
        for warning in caught:
            operator = alerted_operator(str(warning.message))
            if operator is not None:
                if operator not in alerts:
                    alerts.append(operator)
                continue
            warnings.warn_explicit(
                warning.message,
                warning.category,
                warning.filename,
                warning.lineno,
                registry=_REISSUED,
                source=warning.source,
            )


def second_run_reason(alerts: Sequence[str], device: torch.device, asked: bool) -> str:
    """Why the parity control must run a second time, or ``""`` when one run is enough.

    One run is enough where every run is known to be deterministic: on the CPU (every aten CPU
    kernel deterministic under torch's flag, gloo's reductions deterministic for a given
    buffer) with no alert. An alert anywhere, or a run on another device, needs the spread of
    two control runs; ``asked``: ``measure_spread=True``.
    """
    if asked:
        return "measure_spread=True"
    if alerts:
        return "torch has no deterministic implementation of " + ", ".join(alerts)
    if device.type != "cpu":
        return (
            f"on {device.type}: torch's deterministic mode covers neither the backend's "
            "reductions nor kernels outside aten"
        )
    return ""
