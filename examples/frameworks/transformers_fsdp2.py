"""Transformers' own FSDP2 path under the FP32-keep contract: copy this file next to your tests.

``from_pretrained(path, dtype=torch.bfloat16, distributed_config=DistributedConfig(fsdp_size=N,
fsdp_mixed_precision=True))`` (Transformers >= 5.24) does three things, in this order (read from
``modeling_utils.py`` and ``transformers/distributed/`` of 5.24.0):

1. builds the model in ``dtype``;
2. shards it: ``prepare_distribute_model`` builds the device meshes, then
   ``maybe_distribute_model`` resolves the FSDP plan (``_fsdp_plan`` / ``base_model_fsdp_plan``,
   plus one ``free_full_weight`` unit per module that owns a kept parameter, "FSDP2 needs one group
   per dtype") and calls ``fully_shard`` on each unit, then on the root, all with the same
   ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
3. loads the checkpoint, casting the tensors its ``dtype_plan`` names to FP32 and ``setattr``-ing
   them as new DTensor parameters before FSDP2's lazy init.

What plugs where (``assert_fp32_keep_contract(..., cast=, shard=, mp_policy=)``):

- ``cast``: the contract's default (``fp32keep.keep_aware_cast``), whose plan follows the
  installed Transformers' own rules: the dtypes step 1 and 3 leave behind.
- ``shard=transformers_shard``: step 2, the same two class methods ``from_pretrained`` calls.
- ``mp_policy=transformers_policy()``: the policy step 2 shards with, taken from Transformers
  itself, so that the contract's expectations follow it (``DistributedConfig`` accepts no other).
- ``check_state_dict=False``: Transformers loads only inside ``from_pretrained``, from files on
  every rank; it has no entry point that loads a state dict into a model already sharded, so
  there is nothing to plug in as ``load=``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers.distributed import DistributedConfig
from transformers.distributed.fsdp import _get_fsdp_policy_kwargs

from examples.frameworks.meshes import require_world_mesh
from fp32keep import KeepPlan, WrapSpec


def distributed_config(world_size: int) -> DistributedConfig:
    """What a Transformers user passes for FSDP2 over ``world_size`` ranks in mixed precision."""
    return DistributedConfig(fsdp_size=world_size, fsdp_mixed_precision=True)


def transformers_policy() -> MixedPrecisionPolicy:
    """The policy Transformers shards with under ``fsdp_mixed_precision=True``."""
    policy = _get_fsdp_policy_kwargs(distributed_config(1))["mp_policy"]
    assert isinstance(policy, MixedPrecisionPolicy)
    return policy


def transformers_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: Transformers' own FSDP2 sharding, in place.

    ``plan`` and ``wrap`` are ignored (Transformers resolves its own keep list and FSDP plan);
    ``mp_policy`` must be :func:`transformers_policy`, the only one Transformers can shard with.
    """
    expected = transformers_policy()
    if mp_policy != expected:
        raise ValueError(
            f"transformers_shard shards with Transformers' own policy {expected}; pass "
            f"mp_policy=transformers_policy() to the contract (got {mp_policy})"
        )
    require_world_mesh(
        mesh, "transformers_shard", "Transformers builds its own meshes over the world"
    )
    world = torch.distributed.get_world_size()
    # from_pretrained builds the model without initialising (or tying) weights, shards it, loads,
    # and ties last (`_finalize_model_loading`): untie first, so the tied embedding is sharded as
    # from_pretrained shards it, and tie again the same way afterwards.
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for target in tied:
        owner, _, name = target.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, name, nn.Parameter(getattr(module, name).detach().clone()))
    cls = type(model)
    config, _device_map, mesh_manager = cls.prepare_distribute_model(distributed_config(world))
    distributed = cls.maybe_distribute_model(model, config, mesh_manager)
    if distributed is not model:
        raise RuntimeError(
            "maybe_distribute_model returned a new module; the contract shards in place"
        )
    if tied:
        model.tie_weights(recompute_mapping=False)
