"""accelerate's FSDP2 path checked by the FP32-keep contract: copy this file next to your tests.

What plugs where (``assert_fp32_keep_contract(..., cast=, shard=, load=, master_dtype=)``):

- ``cast=checkpoint_cast``: the model as ``from_pretrained(..., dtype=torch.bfloat16)`` hands it
  to accelerate, kept modules in FP32 (an explicit cast: under ``master_dtype=torch.float32`` the
  contract's default cast would also upcast, which is accelerate's job here).
- ``shard=accelerate_shard``: an ``Accelerator(mixed_precision=..., fsdp_plugin=
  FullyShardedDataParallelPlugin(fsdp_version=2, ...))`` and accelerate's own
  ``fsdp2_prepare_model``, the function ``Accelerator.prepare`` runs for FSDP2. It upcasts every
  trainable parameter to FP32 (master weights) and lets the policy's ``param_dtype`` cast for
  compute, so the contract must run with ``master_dtype=torch.float32``.
- ``load=accelerate_load``: accelerate's ``fsdp2_load_full_state_dict`` (rank 0 broadcasts).

The fix on torch >= 2.15 is one line in the plugin: ``mixed_precision_policy=fp32keep.keep_policy(
policy, plan, model)``, with a policy that reduces in FP32 and does not cast forward inputs
(:func:`keeping_policy`); :func:`accelerate_shard_keeping` is ``accelerate_shard`` with that line.
accelerate's own FP32 upcast keeps each parameter's identity, so the override that
``keep_policy`` builds before ``prepare`` still recognises the kept ones.

Running it on CPU (gloo) needs three things, read from accelerate 1.15's source:

1. ``Accelerator(cpu=True)``: without it, a CPU-only machine with torchrun's ``LOCAL_RANK`` set
   is taken for a single process (``DistributedType.NO``).
2. With ``cpu=True`` the state is ``MULTI_CPU``, and ``AcceleratorState`` attaches the FSDP
   plugin only for accelerator device types (``MULTI_GPU``, ``MULTI_XPU``, ...), so ``prepare``
   would not shard at all. :func:`make_accelerator` attaches it the way that branch does
   (``set_mixed_precision``, then ``state.fsdp_plugin``); on CUDA it is already attached.
3. No ``ParallelismConfig``: ``fsdp2_prepare_model`` then passes ``mesh=None`` to
   ``fully_shard``, whose default mesh spans the whole world, so the contract's mesh must too.

``Accelerator`` also sets ``ACCELERATE_USE_FSDP=true`` in ``os.environ`` and keeps a process-wide
singleton state; :func:`make_accelerator` resets both before each build so that one check does
not configure the next (the contract's ranks live across tests).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, DistributedType
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict, fsdp2_prepare_model
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.frameworks.meshes import require_world_mesh
from fp32keep import KeepPlan, WrapSpec, keep_aware_cast, keep_policy

MIXED_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""accelerate's ``mixed_precision`` string for each low-precision ``param_dtype``."""

_ENV_SET_BY_ACCELERATOR = ("ACCELERATE_USE_FSDP",)


def accelerate_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The policy accelerate builds from ``Accelerator(mixed_precision=...)`` alone.

    ``param_dtype``, ``reduce_dtype`` and ``output_dtype`` all ``dtype``; ``cast_forward_inputs``
    left at FSDP2's default (True). Pass it as the contract's ``mp_policy`` to check accelerate
    as its users get it out of the box.
    """
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision(MIXED_PRECISION[dtype])
    policy = plugin.mixed_precision_policy
    assert isinstance(policy, MixedPrecisionPolicy)
    return policy


def keeping_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """accelerate's policy as the keep needs it: compute and output in ``dtype`` as accelerate
    does, but gradients reduced in FP32 (a kept parameter's gradient must not be rounded to
    ``dtype``) and forward inputs left as they come (a kept module's FP32 output must reach the
    next unit in FP32, as in the unsharded model)."""
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=dtype, cast_forward_inputs=False
    )


def make_accelerator(mp_policy: MixedPrecisionPolicy) -> Accelerator:
    """A fresh ``Accelerator`` configured for FSDP2 training with ``mp_policy``.

    The plugin is what an accelerate user writes for FSDP2: ``fsdp_version=2``, one unit per
    ``_no_split_modules`` layer (``transformer_based_wrap``), parameters resharded after forward,
    full state dicts; ``mixed_precision_policy`` is the contract's policy, so that the contract
    judges the policy accelerate really shards with.
    """
    if mp_policy.param_dtype not in MIXED_PRECISION:
        raise ValueError(
            f"mp_policy.param_dtype={mp_policy.param_dtype} has no accelerate mixed_precision "
            f"mode; use one of {sorted(map(str, MIXED_PRECISION))}"
        )
    mixed_precision = MIXED_PRECISION[mp_policy.param_dtype]
    AcceleratorState._reset_state(reset_partial_state=True)
    for name in _ENV_SET_BY_ACCELERATOR:
        os.environ.pop(name, None)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
        cpu_ram_efficient_loading=False,
        mixed_precision_policy=mp_policy,
    )
    on_cpu = not torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin, cpu=on_cpu)
    if accelerator.distributed_type != DistributedType.FSDP:
        # MULTI_CPU: attach the plugin as AcceleratorState does for accelerator devices.
        plugin.set_mixed_precision(mixed_precision)
        accelerator.state.fsdp_plugin = plugin
    for name in _ENV_SET_BY_ACCELERATOR:
        os.environ.pop(name, None)
    return accelerator


_ACCELERATORS: dict[int, Accelerator] = {}
"""The accelerator that sharded each model (by ``id``), for :func:`accelerate_load`."""


def accelerate_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: accelerate's ``fsdp2_prepare_model``, in place.

    ``plan`` and ``wrap`` are ignored: accelerate knows no keep list and wraps
    ``_no_split_modules`` itself; that is what the contract judges.
    """
    require_world_mesh(mesh, "accelerate_shard")
    accelerator = make_accelerator(mp_policy)
    prepared = fsdp2_prepare_model(accelerator, model)
    if (
        prepared is not model
    ):  # only with cpu_ram_efficient_loading, which make_accelerator turns off
        raise RuntimeError(
            "fsdp2_prepare_model returned a new module; the contract shards in place"
        )
    _ACCELERATORS[id(model)] = accelerator


def accelerate_shard_keeping(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """:func:`accelerate_shard` with the one-line fix: the plugin's policy wrapped by
    ``fp32keep.keep_policy``, so every unit accelerate builds all-gathers the plan's parameters
    in FP32 (torch >= 2.15, FP32 master weights: accelerate's upcast gives those)."""
    accelerate_shard(
        model, mesh=mesh, mp_policy=keep_policy(mp_policy, plan, model), plan=plan, wrap=wrap
    )


def accelerate_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """The contract's ``load``: accelerate's ``fsdp2_load_full_state_dict`` (rank 0 holds it)."""
    accelerator = _ACCELERATORS.get(id(model))
    if accelerator is None:
        raise ValueError("accelerate_load needs a model sharded by accelerate_shard")
    fsdp2_load_full_state_dict(accelerator, model, dict(state_dict or {}))


def checkpoint_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The contract's ``cast``: the model as ``from_pretrained(..., dtype=dtype)`` hands it over.

    Kept tensors FP32, the rest in ``dtype`` (``fp32keep.keep_aware_cast`` follows the installed
    Transformers' rules); accelerate's own FP32 upcast then happens inside :func:`accelerate_shard`.
    """
    keep_aware_cast(model, dtype, plan=plan)
