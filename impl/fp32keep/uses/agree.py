"""One observation of how the model reaches its parameters, the same on every rank of the mesh.

:func:`fp32keep.apply_fsdp2` lays out its units from an observation
(:class:`fp32keep.ParameterUse`) made one of two ways:

* ``example_inputs=``: apply_fsdp2 runs one forward of the unsharded model on them itself
  (:func:`observe_example`), on every rank whose model holds real tensors; a rank whose model is
  on the meta device (the launch pattern "rank 0 real, the rest on meta") runs nothing and
  takes the observation of the ranks that ran;
* ``observed=``: an observation the caller made (:func:`fp32keep.observe_parameter_use`).

Either way :func:`agreed_observation` merges the ranks' observations over the mesh in one small
collective per mesh dimension, so every rank lays out the same units; what is wrong on one rank
(a forward that raised, an observation of another model, both options given) is raised on every
rank, naming the rank, before anything is sharded. Without either nothing is exchanged.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fp32keep.errors import (
    Fp32KeepError,
    Fp32KeepTypeError,
    Fp32KeepValueError,
    hidden_in_tracebacks,
)
from fp32keep.plan.constructed import plan_divergence
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.uses.observe import ParameterUse, observe_parameter_use

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

#: What is wrong on one rank: the error kind (data, sent between ranks, never read back out of
#: the text) and the text.
ObservationProblem = tuple[type[Fp32KeepError], str]

#: ``example_inputs`` and ``observed`` both given.
BOTH = (
    "pass example_inputs= (apply_fsdp2 observes one forward on them) or observed= (an "
    "observation you made with fp32keep.observe_parameter_use), not both"
)


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def observe_example(
    model: nn.Module, example_inputs: object
) -> tuple[ParameterUse | None, ObservationProblem | None]:
    """One forward of ``model`` on ``example_inputs`` (a mapping: keyword arguments; a tuple:
    positional ones), observed, under ``torch.no_grad()`` and with the random number generators
    (torch's and Python's) restored after: ``(observation, None)``; ``(None, None)`` on a rank
    whose model has tensors on the meta device (it runs nothing); ``(None, problem)`` where the
    inputs are of the wrong type or the forward raised."""
    if not isinstance(example_inputs, Mapping | tuple):
        return None, (
            Fp32KeepTypeError,
            "example_inputs must be a mapping of forward keyword arguments ({'input_ids': ids}) "
            f"or a tuple of positional ones ((ids,)), got {type(example_inputs).__name__}",
        )
    if _on_meta(model):
        return None, None
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    python_state = random.getstate()  # the forward may draw (dropout masks, sampling)
    try:
        with (
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            observe_parameter_use(model) as use,
        ):
            if isinstance(example_inputs, Mapping):
                model(**example_inputs)
            else:
                model(*example_inputs)
        random.setstate(python_state)
    except Exception as error:  # the caller's model code: any error is reported, on every rank
        random.setstate(python_state)
        text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        return None, (
            Fp32KeepValueError,
            f"the example forward of {type(model).__name__} raised {text}; pass inputs its "
            "forward takes (as in training), or observed=",
        )
    return use, None


def observation_problem(model: nn.Module, observed: object) -> ObservationProblem | None:
    """What is wrong with an observation the caller passed (``observed=``), or ``None``."""
    if not isinstance(observed, ParameterUse):
        kind: type[Fp32KeepError] = Fp32KeepTypeError
        return kind, f"observed must be a fp32keep.ParameterUse, got {type(observed).__name__}"
    if not observed.complete:
        return (
            Fp32KeepValueError,
            "observed is still recording: pass it after its `with` block ended",
        )
    misfit = observed.misfit(model)
    return None if misfit is None else (Fp32KeepValueError, misfit)


def agreed_observation(
    model: nn.Module,
    observed: object,
    mesh: DeviceMesh,
    plan: KeepPlan | None = None,
    *,
    example_inputs: object = None,
) -> ParameterUse | None:
    """The observation every rank of ``mesh`` lays out from: ``observed`` (the caller's) or one
    forward on ``example_inputs`` (:func:`observe_example`), merged over the ranks; an error on
    every rank when any rank's is unusable, when no rank could run the forward (all on meta),
    or, given ``plan``, when the ranks' plans differ (:func:`fp32keep.plan_divergence`).
    ``None``, with no collective, when neither is given: ``apply_fsdp2`` stays as free of
    collectives as ``fully_shard``, and a rank that raised before it leaves its peers no
    collective to wait in.

    One small collective per mesh dimension (each rank's digest, what is wrong on it, if
    anything, and its plan's digest and unobserved notes; the whole observations only where the
    digests differ)."""
    if observed is None and example_inputs is None:
        return None
    mine: ParameterUse | None
    option = "observed" if example_inputs is None else "example_inputs"
    if example_inputs is None:
        mine = observed if isinstance(observed, ParameterUse) else None
        problem = observation_problem(model, observed)
    elif observed is not None:
        mine, problem, option = None, (Fp32KeepValueError, BOTH), "example_inputs=..., observed"
    else:
        mine, problem = observe_example(model, example_inputs)
    for dim in range(mesh.ndim):
        mine = _agree_over(mesh.get_group(dim), mine, problem, plan, option)
    if mine is None:  # every rank's model is on meta: the same on every rank
        raise Fp32KeepValueError(
            "apply_fsdp2(example_inputs=...): every rank's model has tensors on the meta device, "
            "so no rank can run the example forward; build the model with real tensors on one "
            "rank at least (the rank that holds the checkpoint), or pass observed="
        )
    return mine


def _agree_over(
    group: Any,
    mine: ParameterUse | None,
    problem: ObservationProblem | None,
    plan: KeepPlan | None,
    option: str,
) -> ParameterUse | None:
    """One mesh dimension's exchange: refusals and plan divergences raised on every rank of
    ``group``, else the observations of its ranks (those that have one) merged."""
    ranks = dist.get_process_group_ranks(group)
    accounts: list[Any] = [None] * len(ranks)
    digest = mine.digest() if mine is not None and problem is None else None
    keeps = (plan.digest(), plan.unobserved) if plan is not None else ("", ())
    dist.all_gather_object(accounts, (digest, problem, keeps), group=group)
    refusals = [(rank, bad) for rank, (_, bad, _) in zip(ranks, accounts, strict=True) if bad]
    if refusals:
        raise observation_refusal(refusals, option)
    plans = [(rank, *keeps) for rank, (_, _, keeps) in zip(ranks, accounts, strict=True)]
    divergence = plan_divergence("apply_fsdp2", plans)
    if divergence is not None:  # raised on every rank, before anything is sharded
        raise Fp32KeepValueError(divergence)
    if len({digest for digest, _, _ in accounts}) == 1:
        return mine
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)
    made = [use for use in everyone if use is not None]
    return made[0].merged(made[1:]) if made else None


def observation_refusal(
    refusals: Sequence[tuple[int, ObservationProblem]], option: str = "observed"
) -> Fp32KeepError:
    """The one error every rank raises for what is wrong on some ranks: a
    :class:`fp32keep.errors.Fp32KeepTypeError` when any rank's problem is of the wrong type,
    else a :class:`fp32keep.errors.Fp32KeepValueError`, naming the option (``observed``,
    ``example_inputs``), each rank and its problem. The kind comes from the problems' kinds,
    not from their wording."""
    wrong_type = any(issubclass(kind, TypeError) for _, (kind, _) in refusals)
    error = Fp32KeepTypeError if wrong_type else Fp32KeepValueError
    return error(
        f"apply_fsdp2({option}=...): "
        + "; ".join(f"rank {rank}: {text}" for rank, (_, text) in refusals)
    )
