"""Every outcome a verdict: each step of the contract run in every rank, its crash agreed.

:func:`~pytest_fp32keep.contract.assertion.assert_fp32_keep_contract` runs its steps (:data:`STEPS`:
build, batch, reference, cast, shard, load, forward, backward) through one :class:`Agreement`.
Each step runs in a ``try``; then every rank of the mesh tells the others whether it crashed, in
one ``all_gather_object`` over a side gloo group whose timeout is :data:`AGREE_TIMEOUT_S`. The
side group keeps that collective apart from the step's own: a rank that crashed before one of
FSDP2's all-gathers cannot pair its agreement with a peer's all-gather (which would exchange
garbage or hang), and its wait is bounded whatever the process group's own timeout is. A crash
on any rank becomes, on every rank, a ``crashed`` finding naming the step, the exception and the
ranks (:func:`crash_findings`); the steps that need the crashed one are not run
(:data:`NEEDS`). A refusal by design (:class:`fp32keep.KeepLayoutError` raised on every rank)
is re-raised instead: it is the contract's documented answer to a layout FSDP2 cannot hold.

It also owns the plan check (each rank's keep plan digest, sent with the ``build`` step's
agreement: :func:`plan_problem`) and the batch check: each rank's batch is fingerprinted
(:func:`batch_fingerprint`: shapes, dtypes and bytes, hashed per entry) and sent with the
``batch`` step's agreement; :func:`batch_problem` names the entries that differ from rank 0's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fp32keep import KeepLayoutError, plan_divergence
from pytest_fp32keep.contract.report import Finding

T = TypeVar("T")

#: The steps of the contract, in the order they run.
STEPS = ("build", "batch", "reference", "cast", "shard", "load", "forward", "backward")

#: The later steps that cannot run once a step crashed (they need what it makes).
NEEDS: dict[str, tuple[str, ...]] = {
    "build": STEPS[1:],
    "batch": ("reference", "forward", "backward"),
    "reference": ("forward", "backward"),
    "cast": ("shard", "load", "forward", "backward"),
    "shard": ("load", "forward", "backward"),
    "load": ("forward", "backward"),
    "forward": ("backward",),
    "backward": (),
}

#: How long a rank waits for the others at the end of a step. Ranks reach it together unless
#: one is stuck (a peer crashed before a collective both needed); then it bounds the wait.
AGREE_TIMEOUT_S = 60.0

#: Exceptions that are answers, not crashes, when every rank raises them in the same step.
REFUSALS: tuple[type[Exception], ...] = (KeepLayoutError,)


@dataclasses.dataclass(frozen=True)
class Crash:
    """What one rank's step raised (small and picklable: no exception object)."""

    step: str
    kind: str  # the exception's type name
    line: str  # the first line of its message
    rank: int
    refusal: bool = False


@dataclasses.dataclass(frozen=True)
class _Outcome:
    crash: Crash | None
    shared: object = None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _side_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` for the agreements, made once per default group.

    Made once and never destroyed: a group made again after ``destroy_process_group`` gets the
    same store prefix as the old one, and gloo then connects to stale addresses.
    """
    key = (id(dist.group.WORLD), ranks)
    group = _GROUPS.get(key)
    if group is not None:
        try:
            dist.get_process_group_ranks(group)  # raises once the group was destroyed
            return group
        except (KeyError, RuntimeError, ValueError):
            del _GROUPS[key]
    created = dist.new_group(  # torch >= 2.15 types a non-member's result as a placeholder
        list(ranks),
        backend="gloo",
        timeout=timedelta(seconds=AGREE_TIMEOUT_S),
        use_local_synchronization=True,
    )
    assert isinstance(created, dist.ProcessGroup)  # every caller is a member
    _GROUPS[key] = created
    return created


class Agreement:
    """The ranks of ``mesh`` running the contract's steps, each crash agreed on every rank.

    ``planned`` is the steps this call runs when nothing crashes (``load`` only with the round
    trip).

    Attributes:
        crashes: every rank's crash of the step that crashed (empty while none did).
        error: this rank's own exception of that step, if it raised one (the cause to chain).
    """

    def __init__(self, mesh: DeviceMesh, planned: Sequence[str] = STEPS) -> None:
        self._ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        self._group = _side_group(self._ranks)
        self._planned = tuple(planned)
        self.crashes: list[Crash] = []
        self.error: BaseException | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks of the mesh, in its order (the order of what :meth:`step` shares)."""
        return self._ranks

    @property
    def crashed(self) -> bool:
        """Whether a step crashed on some rank."""
        return bool(self.crashes)

    def runs(self, step: str) -> bool:
        """Whether ``step`` may run: no step it needs has crashed."""
        return not any(step in NEEDS[crash.step] for crash in self.crashes)

    @property
    def skipped(self) -> list[str]:
        """The planned steps that do not run because a step they need crashed."""
        return [step for step in self._planned if not self.runs(step)]

    def step(
        self,
        step: str,
        action: Callable[[], T],
        share: Callable[[T], object] | None = None,
    ) -> tuple[T | None, list[object]]:
        """Run ``action`` as ``step`` on this rank, then agree with every rank of the mesh.

        Returns:
            ``action``'s value (None where any rank crashed) and, per rank of the mesh,
            ``share(value)`` (empty where any rank crashed or no ``share`` is given).

        Raises:
            KeepLayoutError: every rank refused the layout in this step (re-raised as is).
        """
        value: T | None = None
        local: Crash | None = None
        shared: object = None
        try:
            value = action()
            shared = share(value) if share is not None else None
        except Exception as error:  # every crash is a verdict, agreed below
            self.error = error
            local = Crash(
                step,
                type(error).__name__,
                _first_line(error),
                dist.get_rank(),
                isinstance(error, REFUSALS),
            )
        outcomes = self._gather(step, _Outcome(local, shared))
        crashes = [o.crash for o in outcomes if o.crash is not None]
        if crashes and all(c.refusal for c in crashes) and len(crashes) == len(self._ranks):
            assert self.error is not None
            raise self.error
        if crashes:
            self.crashes = crashes
            return None, []
        return value, [o.shared for o in outcomes]

    def on_any_rank(self, what: str, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank of the mesh: one bounded collective.

        For a decision that leads to collectives (the parity control runs FSDP2 on every rank):
        ranks deciding on their own local facts would enter different collectives. A rank that
        never comes counts as True; the caller's collectives then meet the same bound.
        """
        outcomes = self._gather(what, _Outcome(None, flag))
        return any(bool(o.shared) or o.crash is not None for o in outcomes)

    def _gather(self, step: str, local: _Outcome) -> list[_Outcome]:
        gathered: list[Any] = [None] * len(self._ranks)
        try:
            dist.all_gather_object(gathered, local, group=self._group)
        except RuntimeError as error:  # a rank never came: its peers must not wait for ever
            _GROUPS.pop((id(dist.group.WORLD), self._ranks), None)  # a timed-out group is spent
            late = Crash(
                step,
                "Timeout",
                f"not every rank of the mesh {list(self._ranks)} finished the step within "
                f"{AGREE_TIMEOUT_S:g} s (a rank stuck in a collective its peer left: "
                f"{_first_line(error)})",
                dist.get_rank(),
            )
            return [local, _Outcome(late)] if local.crash is not None else [_Outcome(late)]
        return [outcome for outcome in gathered if isinstance(outcome, _Outcome)]

    def findings(self) -> list[Finding]:
        """The ``crashed`` findings: one per distinct exception of the crashed step."""
        return crash_findings(self.crashes)

    def notes(self) -> list[str]:
        """What the report must say about the steps that did not run."""
        if not self.crashes:
            return []
        step = self.crashes[0].step
        if not self.skipped:
            return [f"{step} crashed; every step it feeds had run"]
        return [
            f"not run after the crashed {step}: {', '.join(self.skipped)} (each needs it); "
            "their rows are absent, not passed"
        ]


def crash_findings(crashes: Sequence[Crash]) -> list[Finding]:
    """One ``crashed`` finding per distinct exception, naming the ranks that raised it."""
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for crash in crashes:
        grouped.setdefault((crash.step, crash.kind, crash.line), []).append(crash.rank)
    findings = []
    for (step, kind, line), ranks in grouped.items():
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"
        message = f"{kind}: {line}" if line else kind
        findings.append(Finding("crashed", step, "no exception", f"{message} ({where})", False))
    return findings


# --- the batch ---------------------------------------------------------------------------------


def _entries(value: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest = hashlib.sha256(repr((tuple(data.shape), str(data.dtype))).encode())
        if data.numel():
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        return [(path, digest.hexdigest())]
    if isinstance(value, Mapping):
        return [
            e
            for key, item in value.items()
            for e in _entries(item, f"{path}{key}" if not path else f"{path}.{key}")
        ]
    if isinstance(value, (list, tuple)):
        return [e for i, item in enumerate(value) for e in _entries(item, f"{path}[{i}]")]
    return [(path, hashlib.sha256(repr(value).encode()).hexdigest())]


def batch_fingerprint(batch: Any) -> dict[str, str]:
    """Each entry of ``batch`` (by key path; ``batch`` for a lone tensor) and a hash of its
    shape, dtype and bytes (``repr`` for anything that is not a tensor)."""
    return (
        dict(_entries(batch, ""))
        if not isinstance(batch, torch.Tensor)
        else dict(_entries(batch, "batch"))
    )


def plan_account(models: Any) -> tuple[str, tuple[str, ...]]:
    """What a rank shares of its built models' keep plan: its digest and unobserved notes."""
    return models.plan.digest(), models.plan.unobserved


def plan_problem(accounts: Sequence[object], ranks: Sequence[int]) -> str | None:
    """The message naming the ranks whose keep plan differs from the first rank's (and what
    each rank could not observe), or None (:func:`fp32keep.plan_divergence`)."""
    rows = []
    for rank, account in zip(ranks, accounts, strict=True):
        assert isinstance(account, tuple)
        rows.append((rank, *account))
    return plan_divergence("assert_fp32_keep_contract", rows)


def batch_problem(fingerprints: Sequence[object], ranks: Sequence[int]) -> str | None:
    """The message naming every rank whose batch differs from the first rank's, or None."""
    first = fingerprints[0]
    assert isinstance(first, dict)
    differing = []
    for rank, other in zip(ranks[1:], fingerprints[1:], strict=True):
        assert isinstance(other, dict)
        if other == first:
            continue
        names = sorted(k for k in {*first, *other} if first.get(k) != other.get(k))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        differing.append(f"rank {rank} built a different batch: {shown} differ")
    if not differing:
        return None
    if len(differing) > 5:  # a few KB whatever the world size
        differing[5:] = [f"and {len(differing) - 5} more ranks"]
    return (
        "assert_fp32_keep_contract: "
        + "; ".join(differing)
        + f" (compared with rank {ranks[0]}'s); seed your batch_factory (e.g. draw from "
        "torch.Generator().manual_seed(0)): every rank must build the same batch"
    )
