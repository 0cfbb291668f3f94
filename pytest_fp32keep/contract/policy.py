"""The caller's ``MixedPrecisionPolicy``, as a correct implementation applies it.

The contract judges the implementation under the policy it is given (accelerate's out of the
box: parameters, gradients and outputs in the low dtype, inputs cast at every unit;
Transformers' ``distributed_config``: bf16 compute over fp16 storage). What that policy does to
the numbers is not a keep defect, so the unsharded reference does it too, exactly as FSDP2 does
it at the units the implementation made:

* **compute dtypes** (:func:`compute_dtypes`, :func:`cast_for_compute`): a parameter the plan
  keeps computes in FP32; every other parameter in the policy's ``param_dtype``, or in its own
  storage dtype where the policy has none (FSDP2 all-gathers ``param_dtype(stored)``, so the
  reference's copy is its stored value cast the same way);
* **unit boundaries** (:func:`unit_casts`): at each module of each FSDP2 unit, the input cast
  (``cast_forward_inputs`` with a ``param_dtype``) and the output cast (``output_dtype``) of the
  policy the contract prescribes for that unit (:func:`correct_policy`), which for a unit of
  kept parameters casts nothing. A unit of the implementation that casts at a kept module's
  boundary therefore differs from the reference there: a ``boundary`` row naming the dtypes,
  the cast's own signature;
* **gradients** (:func:`expected_grads`): FSDP2 reduces each gradient in ``reduce_dtype`` and
  stores it in the parameter's dtype, so the reference's gradient is held in the dtype each
  parameter is stored in.

Nothing here is taken from how the implementation set up its units beyond which modules they
are: their policies are the contract's, so an implementation that gives a kept unit the
caller's policy is caught, never copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep import KeepPlan

__all__ = [
    "cast_floating",
    "cast_for_compute",
    "compute_dtypes",
    "correct_policy",
    "expected_grads",
    "unit_casts",
]


def correct_policy(
    params: Collection[str], plan: KeepPlan, policy: MixedPrecisionPolicy
) -> MixedPrecisionPolicy:
    """The policy the contract prescribes for a unit managing ``params`` (fully qualified names).

    A unit holding only kept parameters computes as the unsharded model does: ``param_dtype=None``
    (all-gathered in its FP32 storage dtype, inputs not cast), ``output_dtype=None`` (the module
    hands back what its own code makes), and a ``reduce_dtype`` below 32 bits dropped (FP32
    gradients averaged in bf16 would lose their low bits); every other field is the caller's.
    Any other unit gets the caller's policy unchanged: what plain FSDP2 gives it.
    """
    if not params or not all(name in plan for name in params):
        return policy
    reduce_dtype = policy.reduce_dtype
    if reduce_dtype is not None and torch.finfo(reduce_dtype).bits < 32:
        reduce_dtype = None
    return dataclasses.replace(
        policy, param_dtype=None, output_dtype=None, reduce_dtype=reduce_dtype
    )


def compute_dtypes(
    model: nn.Module,
    plan: KeepPlan,
    policy: MixedPrecisionPolicy,
    storage: Mapping[str, torch.dtype],
) -> dict[str, torch.dtype]:
    """The dtype each floating parameter of ``model`` computes in under ``policy`` when the
    keep is correct: FP32 where the plan keeps it, else the policy's ``param_dtype``, else the
    dtype it is stored in (``storage``: :func:`~.master.expected_storage`)."""
    dtypes: dict[str, torch.dtype] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.is_floating_point():
            continue
        if name in plan:
            dtypes[name] = torch.float32
        else:
            dtypes[name] = policy.param_dtype or storage.get(name, param.dtype)
    return dtypes


def cast_for_compute(
    model: nn.Module,
    plan: KeepPlan,
    policy: MixedPrecisionPolicy,
    storage: Mapping[str, torch.dtype],
) -> list[str]:
    """Cast ``model``'s parameters (in place, identity kept) from the dtype they hold to the one
    they compute in (:func:`compute_dtypes`), through their storage dtype, as FSDP2's all-gather
    does; return the names of those that changed. Buffers are left alone: FSDP2 never casts
    them."""
    changed: list[str] = []
    wanted = compute_dtypes(model, plan, policy, storage)
    for name, param in model.named_parameters():  # one per tensor; aliases share it
        dtype = wanted.get(name)
        if dtype is None or param.dtype == dtype:
            continue
        stored = storage.get(name, param.dtype)
        param.data = param.data.to(stored).to(dtype)
        changed.append(name)
    return changed


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor inside it cast to ``dtype``, through the containers
    FSDP2 looks into: tensors, dataclasses (a Transformers ``ModelOutput``), mappings, named
    tuples, lists, tuples and sets; anything else is returned as it is."""

    def cast(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item.to(dtype) if item.is_floating_point() and item.dtype != dtype else item
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            fields = {f.name: cast(getattr(item, f.name)) for f in dataclasses.fields(item)}
            return dataclasses.replace(item, **fields)
        if isinstance(item, OrderedDict):
            return type(item)((key, cast(entry)) for key, entry in item.items())
        if isinstance(item, dict):
            return {key: cast(entry) for key, entry in item.items()}
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # a named tuple
            return type(item)(*(cast(entry) for entry in item))
        if isinstance(item, (list, tuple, set)):
            return type(item)(cast(entry) for entry in item)
        return item

    return cast(value)


def _input_cast(dtype: torch.dtype) -> Callable[..., tuple[Any, dict[str, Any]]]:
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return hook


def _output_cast(dtype: torch.dtype) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return cast_floating(output, dtype)

    return hook


@contextlib.contextmanager
def unit_casts(
    model: nn.Module,
    units: Sequence[tuple[Sequence[str], Collection[str]]],
    plan: KeepPlan,
    policy: MixedPrecisionPolicy,
) -> Iterator[list[str]]:
    """Within the block, each module of each unit (its modules' fully qualified names, the
    parameters it manages) casts its floating inputs and outputs as FSDP2 would under
    :func:`correct_policy`; yields the units' modules ``model`` does not have (none are cast).

    The input cast is a forward pre-hook put first and the output cast a forward hook put
    last among those present, as FSDP2 places its own, so a probe attached inside the block
    sees what it sees in the sharded model."""
    modules = dict(model.named_modules(remove_duplicate=False))
    missing: list[str] = []
    handles: list[torch.utils.hooks.RemovableHandle] = []
    try:
        for names, params in units:
            unit_policy = correct_policy(params, plan, policy)
            for name in names:
                module = modules.get(name)
                if module is None:
                    missing.append(name)
                    continue
                if unit_policy.cast_forward_inputs and unit_policy.param_dtype is not None:
                    handles.append(
                        module.register_forward_pre_hook(
                            _input_cast(unit_policy.param_dtype), prepend=True, with_kwargs=True
                        )
                    )
                if unit_policy.output_dtype is not None:
                    handles.append(
                        module.register_forward_hook(_output_cast(unit_policy.output_dtype))
                    )
        yield missing
    finally:
        for handle in handles:
            handle.remove()


def expected_grads(
    grads: Mapping[str, torch.Tensor | None],
    storage: Mapping[str, torch.dtype],
    scale: float = 1.0,
) -> dict[str, torch.Tensor | None]:
    """The reference's gradients in the dtype each parameter is stored in, where FSDP2 leaves
    them: computed in the compute dtype, reduced in ``reduce_dtype``, stored in the parameter's
    dtype. Casting the compute-dtype gradient to the storage dtype is what that yields wherever
    the reduction is exact (an FP32 master's gradient is the upcast, exact; a bf16 gradient of an
    fp16 parameter rounds once, as FSDP2's does).

    ``scale`` (:func:`~.scale.gradient_scale`: ``world_size / factor`` for a framework's own
    gradient divide factor) multiplies each gradient in float64 before that one cast, so a
    power-of-two scale is exact and any other rounds once, to the stored dtype."""

    def held(name: str, grad: torch.Tensor) -> torch.Tensor:
        if scale == 1.0:
            return grad.to(storage[name])
        return (grad.to(torch.float64) * scale).to(storage[name])

    return {
        name: grad
        if grad is None or not grad.is_floating_point() or name not in storage
        else held(name, grad)
        for name, grad in grads.items()
    }
