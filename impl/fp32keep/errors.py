"""The exceptions fp32keep raises at its boundaries, before it changes anything.

Every one derives from :class:`Fp32KeepError` (``except fp32keep.Fp32KeepError`` catches all
that the library raises) and from the built-in exception it has always been, so an
``except ValueError`` written before the common base existed still catches what it caught.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fp32keep.reprs import SHOWN


def hidden_in_tracebacks(excinfo: Any) -> bool:
    """Whether pytest hides a frame of fp32keep from a failing test's traceback: when the error
    is one fp32keep raises on purpose (an :class:`Fp32KeepError`, whose message says what is
    wrong and what to do), not when it is a bug of the library.

    Every fp32keep module sets it as its ``__tracebackhide__`` (pytest reads that name from a
    frame's globals and calls it with the exception), so a refused layout shows the test's own
    line and the message, not ``apply_fsdp2``'s and ``plan_layout``'s docstrings and source.
    """
    return isinstance(getattr(excinfo, "value", None), Fp32KeepError)


class Fp32KeepError(Exception):
    """The base of every error fp32keep raises.

    Each concrete error also derives from a built-in exception (``ValueError``, ``TypeError``,
    ``RuntimeError`` or ``NotImplementedError``), the one it raised before this base existed.
    """


class Fp32KeepValueError(Fp32KeepError, ValueError):
    """A bad value: an argument, a model state or a rank disagreement fp32keep cannot work with."""


class Fp32KeepTypeError(Fp32KeepError, TypeError):
    """An argument of the wrong type (a mesh that is no ``DeviceMesh``, a dtype that is no
    ``torch.dtype``, a checkpoint path where a state dict belongs)."""


class Fp32KeepRuntimeError(Fp32KeepError, RuntimeError):
    """The environment is not ready: no initialised process group, or a torch release whose
    FSDP2 internals fp32keep's hooks cannot find."""


class SourceFallbackWarning(UserWarning):
    """:func:`fp32keep.apply_fsdp2` laid out its units from the model's source (neither
    ``example_inputs=`` nor ``observed=`` given), which shows uses it cannot judge: a method
    other than ``forward`` called on a child with parameters, a child handed to a function, a
    class with no source. The message names each; pass ``example_inputs=`` to observe instead."""


class Fp32KeepNotImplementedError(Fp32KeepError, NotImplementedError):
    """A supported-looking input fp32keep does not handle (tensor-parallel placements)."""


class KeepDeclarationError(Fp32KeepValueError):
    """A ``_keep_in_fp32_modules``/``_keep_in_fp32_modules_strict`` declaration is unusable."""


class KeepPlanError(Fp32KeepValueError):
    """A keep plan used where it does not fit: resolved on another model, or for another
    dtype than the cast's or the mixed-precision policy's ``param_dtype``. Raised before
    anything is changed."""


@dataclass(frozen=True)
class LayoutProblem:
    """One tensor FSDP2 cannot shard without breaking the keep contract.

    Attributes:
        fqn: the fully qualified name of the parameter (or one alias of it).
        reason: a short machine-readable tag, e.g. ``"root-owned"`` or ``"mixed-unit"``.
        detail: what is wrong and what to do about it, for people.
    """

    fqn: str
    reason: str
    detail: str


class KeepLayoutError(Fp32KeepValueError):
    """The model's layout cannot keep its FP32 parameters under FSDP2.

    Raised by :func:`fp32keep.apply_fsdp2` after validating the whole layout and before any
    module is sharded: no module is an ``FSDPModule`` afterwards and no parameter changed.
    ``problems`` lists every offending tensor with the reason; the message names the first
    five of each reason and counts the rest.
    """

    def __init__(self, problems: Sequence[LayoutProblem], *, model_name: str = "model") -> None:
        self.problems: tuple[LayoutProblem, ...] = tuple(problems)
        reasons = sorted({problem.reason for problem in self.problems})
        lines = [
            f"FSDP2 cannot keep the FP32 contract of {model_name}: "
            f"{len(self.problems)} problem(s) ({', '.join(reasons)}); nothing was sharded."
        ]
        # The first few of each reason, so that a model with thousands of problems gets a
        # message of a few KB that still shows every kind; ``problems`` holds them all.
        found = Counter(problem.reason for problem in self.problems)
        seen: Counter[str] = Counter()
        shown = []
        for problem in self.problems:
            seen[problem.reason] += 1
            if seen[problem.reason] <= SHOWN:
                shown.append(problem)
        width = max((len(problem.fqn) for problem in shown), default=0)
        for problem in shown:
            lines.append(f"  {problem.fqn:<{width}}  [{problem.reason}] {problem.detail}")
        lines += [
            f"  … and {count - SHOWN} more [{reason}] (error.problems lists every one)"
            for reason, count in sorted(found.items())
            if count > SHOWN
        ]
        super().__init__("\n".join(lines))

    @property
    def fqns(self) -> tuple[str, ...]:
        """The offending tensor names, in the order they were found."""
        return tuple(problem.fqn for problem in self.problems)


class StateDictError(Fp32KeepValueError):
    """A full state dict does not fit the model; raised on every rank before any tensor moves.

    Attributes:
        missing: destination keys with no entry in the state dict.
        unexpected: state-dict keys the model does not have.
        mismatched: ``(key, reason)`` pairs for entries that cannot be loaded: wrong shape, kind
            or dtype family, not a plain dense tensor, unreadable, or tied aliases that disagree.
        uninitialized: model tensors on the meta device that nothing would initialise (a missing
            key under ``strict=False``, a non-persistent buffer no rank can send).
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, str]] = (),
        uninitialized: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = tuple(mismatched)
        self.uninitialized = tuple(uninitialized)
