"""``fp32keep check --cast/--shard/--load/--policy``: a framework's own implementation, plugged in.

Each option names ``package.module:function``, imported as a TARGET and ``--batch`` are
(:func:`~pytest_fp32keep.check.targets.import_callable`), and replaces fp32keep's own step in
every case of the run, as the contract's keyword of the same job does
(:func:`~pytest_fp32keep.contract.assert_fp32_keep_contract`):

* ``--cast``: ``cast=``, called as ``cast(model, dtype, plan)``;
* ``--shard``: ``shard=``, called as ``shard(model, *, mesh, mp_policy, plan, wrap)``;
* ``--load``: ``load=``, called as ``load(model, state_dict)``; ``--load none`` loads nothing
  (``check_state_dict=False``, for frameworks that load only inside their own
  ``from_pretrained``): the round trip is not judged, and the report says so;
* ``--policy``: ``mp_policy=``, the function's ``MixedPrecisionPolicy`` for each ``--dtype``.
  A function that can be called with one positional argument gets the dtype
  (``accelerate_policy(torch.bfloat16)``); one that can only be called with none is called so
  (Transformers' ``transformers_policy()``): :func:`policy_takes_dtype` reads that from its
  signature, never by calling it.

Everything is checked in the command, before any rank starts (:func:`resolve_plugins`): the
import, the attribute, that it is callable, that its signature accepts the call the contract
makes, and for ``--policy`` that it returns a ``MixedPrecisionPolicy`` for each dtype. The ranks
resolve the same strings again (:class:`Plugins` travels in the spec as text).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from pytest_fp32keep.check.targets import TargetError, import_callable

#: ``--load none``: no state dict is loaded, the round trip is not judged.
LOAD_NONE = "none"


@dataclasses.dataclass(frozen=True)
class Call:
    """How the contract calls one plug-in: its positional arguments, then its keywords."""

    positional: tuple[str, ...]
    keywords: tuple[str, ...] = ()

    def shown(self) -> str:
        """``(model, *, mesh, mp_policy, plan, wrap)``."""
        keywords = ("*", *self.keywords) if self.keywords else ()
        return f"({', '.join([*self.positional, *keywords])})"

    def problem(self, function: Callable[..., Any]) -> str | None:
        """Why ``function`` cannot be called this way, or ``None`` (also where Python cannot
        read its signature: a builtin is given the benefit of the doubt)."""
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            return None
        try:
            signature.bind(*self.positional, **dict.fromkeys(self.keywords))
        except TypeError as error:
            return str(error)
        return None


#: The call the contract makes for each option that replaces a step.
CALLS = {
    "cast": Call(("model", "dtype", "plan")),
    "shard": Call(("model",), ("mesh", "mp_policy", "plan", "wrap")),
    "load": Call(("model", "state_dict")),
}


@dataclasses.dataclass(frozen=True)
class Plugins:
    """The options as given: ``package.module:function``, or ``None`` where fp32keep's own step
    runs (``load`` may also be :data:`LOAD_NONE`). Its :meth:`to_dict` is the spec's and the
    JSON report's ``plugins``."""

    cast: str | None = None
    shard: str | None = None
    load: str | None = None
    policy: str | None = None
    load_on_every_rank: bool = False
    """``--load-on-every-rank``: ``--load`` takes the full state dict on every rank."""
    gradient_divide_factor: float | None = None
    """``--gradient-divide-factor``: the framework divides summed gradients by this instead of
    FSDP2's world size (``assert_fp32_keep_contract(gradient_divide_factor=...)``)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plugins:
        return cls(
            args.cast,
            args.shard,
            args.load,
            args.policy,
            args.load_on_every_rank,
            args.gradient_divide_factor,
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Plugins:
        return cls(
            **{
                field.name: values.get(field.name, field.default)
                for field in dataclasses.fields(cls)
            }
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def plugged(self) -> bool:
        """Whether anything replaces one of fp32keep's own steps, the default policy or the
        contract's conventions (where the load's dict is, how gradients are scaled)."""
        return any(value not in (None, False) for value in self.to_dict().values())


@dataclasses.dataclass(frozen=True)
class ResolvedPlugins:
    """The functions :class:`Plugins` names (``None``: the contract's default)."""

    cast: Callable[..., Any] | None = None
    shard: Callable[..., Any] | None = None
    load: Callable[..., Any] | None = None
    check_state_dict: bool = True
    policy: Callable[..., Any] | None = None
    policy_spec: str = ""
    load_on_every_rank: bool = False
    gradient_divide_factor: float | None = None

    def policy_for(self, dtype: torch.dtype) -> MixedPrecisionPolicy | None:
        """``--policy``'s policy for ``dtype`` (``None`` without ``--policy``)."""
        if self.policy is None:
            return None
        name = getattr(self.policy, "__name__", "policy")
        takes_dtype = policy_takes_dtype(self.policy)
        called = f"{name}({dtype})" if takes_dtype else f"{name}()"
        try:
            policy = self.policy(dtype) if takes_dtype else self.policy()
        except Exception as error:
            raise TargetError(
                f"--policy {self.policy_spec!r}: {called} raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TargetError(
                f"--policy {self.policy_spec!r}: {called} returned a {type(policy).__name__}, "
                "not a torch.distributed.fsdp.MixedPrecisionPolicy: return the policy to shard "
                "with"
            )
        return policy

    def contract_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        """The keywords of ``assert_fp32_keep_contract`` for a case at ``dtype``: only what is
        plugged in, so that every other step keeps the contract's own default."""
        found: dict[str, Any] = {
            name: function
            for name, function in (("cast", self.cast), ("shard", self.shard), ("load", self.load))
            if function is not None
        }
        if not self.check_state_dict:
            found["check_state_dict"] = False
        if self.load_on_every_rank:
            found["load_on_every_rank"] = True
        if self.gradient_divide_factor is not None:
            found["gradient_divide_factor"] = self.gradient_divide_factor
        policy = self.policy_for(dtype)
        if policy is not None:
            found["mp_policy"] = policy
        return found


def policy_takes_dtype(function: Callable[..., Any]) -> bool:
    """Whether ``--policy``'s function is called with the dtype: it accepts one positional
    argument (``(dtype)``, ``(dtype=torch.bfloat16)``, ``(*args)``); else it is called with none.
    A signature Python cannot read counts as ``(dtype)``."""
    return _policy_problem(function, arguments=1) is None


def _policy_problem(function: Callable[..., Any], arguments: int | None = None) -> str | None:
    """Why ``--policy``'s function cannot be called with ``arguments`` positional arguments
    (``None``: neither with the dtype nor with none; the dtype call's reason is the one
    given)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    counts = (arguments,) if arguments is not None else (1, 0)
    problems = []
    for count in counts:
        try:
            signature.bind(*[torch.bfloat16] * count)
        except TypeError as error:
            problems.append(str(error))
        else:
            return None
    return problems[0]


def _resolved(option: str, spec: str) -> Callable[..., Any]:
    """``--option spec`` imported and its signature checked against the contract's call."""
    what = f"--{option}"
    function = import_callable(spec, what=what)
    call = CALLS.get(option)
    problem = call.problem(function) if call is not None else _policy_problem(function)
    if problem is None:
        return function
    name = getattr(function, "__name__", spec.partition(":")[2])
    if call is not None:
        wanted, fix = f"{option}{call.shown()}", f"def {name}{call.shown()}: ..."
    else:
        wanted = f"{name}(dtype) or {name}()"
        fix = f"def {name}(dtype): ..., returning a MixedPrecisionPolicy"
    raise TargetError(
        f"{what} {spec!r}: {name}{_signature(function)} cannot be called as {wanted} "
        f"({problem}); define it as {fix}"
    )


def _signature(function: Callable[..., Any]) -> str:
    """``(model, mesh)``: the parameters as written, without their annotations."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return "(...)"
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=empty))


def resolve_plugins(plugins: Plugins, dtypes: Iterable[torch.dtype] = ()) -> ResolvedPlugins:
    """Import and check every plug-in; call ``--policy`` for each of ``dtypes`` (the command
    passes every ``--dtype``, so a policy that raises or returns something else is an error
    before any rank starts). Raises :class:`TargetError` naming the option, the value and the
    fix."""
    load_none = plugins.load == LOAD_NONE
    if plugins.load_on_every_rank and (plugins.load is None or load_none):
        raise TargetError(
            f"--load-on-every-rank with --load {plugins.load or '(not given)'}: it says where "
            "your own loader takes the full state dict; pass --load MODULE:FUNCTION too, or "
            "drop --load-on-every-rank (fp32keep's loader takes it on rank 0)"
        )

    def function(option: str, spec: str | None) -> Callable[..., Any] | None:
        return None if spec is None else _resolved(option, spec)

    resolved = ResolvedPlugins(
        cast=function("cast", plugins.cast),
        shard=function("shard", plugins.shard),
        load=None if load_none else function("load", plugins.load),
        check_state_dict=not load_none,
        policy=function("policy", plugins.policy),
        policy_spec=plugins.policy or "",
        load_on_every_rank=plugins.load_on_every_rank,
        gradient_divide_factor=plugins.gradient_divide_factor,
    )
    for dtype in dtypes:
        resolved.policy_for(dtype)
    return resolved
