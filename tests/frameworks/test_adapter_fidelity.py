"""``transformers_shard`` lays a model out exactly as ``from_pretrained(distributed_config=...)``.

The adapter replays from_pretrained's sharding step on a model built in memory; this checks the
claim against the real thing: a zoo model saved, loaded back by ``from_pretrained`` with a
``DistributedConfig``, and compared unit by unit (which modules are FSDP units, the
``param_dtype`` each all-gathers in) and tensor by tensor (DTensor or not, local dtype). The
negative control: ``fp32keep.apply_fsdp2``'s layout of the same model is told apart.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

import fp32keep
from examples.frameworks.transformers_fsdp2 import (
    distributed_config,
    transformers_policy,
    transformers_shard,
)
from pytest_fp32keep.check.zoo import ZOO
from pytest_fp32keep.contract.fsdp_state import unit_of

pytestmark = pytest.mark.slow  # breadth at pinned versions (conftest.py)


def layout(model: nn.Module) -> dict[str, Any]:
    """Every FSDP unit with its all-gather dtype, every parameter with its kind and local dtype."""
    units = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            policy = unit_of(module).policy
            units[name or "<root>"] = None if policy is None else str(policy.param_dtype)
    params = {
        name: (type(p.data).__name__, str(getattr(p, "_local_tensor", p).dtype))
        for name, p in model.named_parameters()
    }
    return {"units": units, "params": params}


def _shared_folder(rank: int) -> str:
    folder = [tempfile.mkdtemp(prefix="fp32keep-fw-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    assert folder[0] is not None
    return folder[0]


@pytest.mark.fsdp2(nproc=2)
@pytest.mark.parametrize("model", ["ernie4_5_moe", "deepseek_v3"])
def test_transformers_shard_is_from_pretrained_sharding(
    fsdp2_mesh: DeviceMesh, fsdp2_rank: int, model: str
) -> None:
    entry = ZOO[model]
    folder = _shared_folder(fsdp2_rank)
    try:
        if fsdp2_rank == 0:
            entry.build().save_pretrained(folder)
        dist.barrier()
        real = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch.bfloat16,
            distributed_config=distributed_config(dist.get_world_size()),
        )
        dist.barrier()
    finally:
        if fsdp2_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def built(shard: Any, **policy: Any) -> nn.Module:
        ours = entry.build()
        plan = fp32keep.resolve_keep_plan(ours, torch.bfloat16)
        fp32keep.keep_aware_cast(ours, torch.bfloat16, plan=plan)
        shard(ours, mesh=fsdp2_mesh, plan=plan, wrap=None, **policy)
        return ours

    expected = layout(real)
    assert layout(built(transformers_shard, mp_policy=transformers_policy())) == expected
    # The negative control: fp32keep's own layout (kept units all-gathered in FP32) differs.
    control = layout(built(fp32keep.apply_fsdp2, mp_policy=transformers_policy()))
    assert control["units"] != expected["units"]
