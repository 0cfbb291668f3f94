"""Replicated kept parameters end on the mesh's device (issue 12), on any backend.

A frozen kept parameter in a mixed module is left out of FSDP2 (``ignored_params``), and
``fully_shard`` does not move ignored parameters: ``apply_fsdp2`` moves them to the mesh's device
itself, and the loader materialises meta ones there. On gloo the mesh's device is the CPU, so
what is observed to move is a meta parameter (every rank but the source builds on meta); under
ci/gpu-check (NCCL) the source rank builds on the CPU and its parameter must reach CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from tests.core.toys import stack_class

pytestmark = pytest.mark.fsdp2  # the default ranks: 2 on gloo, every GPU in ci/gpu-check

BF16, FP32 = torch.bfloat16, torch.float32


def with_replicated_bias() -> tuple[nn.Module, fp32keep.KeepPlan]:
    model = stack_class(strict=["expert_bias"])()
    for layer in model.layers:
        layer.attn.register_parameter(
            "expert_bias", nn.Parameter(torch.randn(8), requires_grad=False)
        )
    plan = fp32keep.resolve_keep_plan(model, BF16)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, plan


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.cuda.current_device())


def test_replicated_kept_parameters_end_on_the_mesh_device(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    on_source = dist.get_rank() == 0
    if on_source:  # built on the CPU whatever the mesh's device
        model, plan = with_replicated_bias()
    else:
        with torch.device("meta"):
            model, plan = with_replicated_bias()
    fp32keep.apply_fsdp2(
        model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16), plan=plan
    )
    bias = model.layers[0].attn.expert_bias
    assert not isinstance(bias, DTensor)  # replicated, not sharded
    assert bias.is_meta != on_source
    if on_source:  # apply_fsdp2 moved it, as fully_shard moved the sharded ones
        assert bias.device == mesh_device(mesh), bias.device
    generator = torch.Generator().manual_seed(7)
    source = {
        name: torch.randn(value.shape, generator=generator)
        for name, value in model.state_dict().items()
    }
    fp32keep.load_full_state_dict(model, source if on_source else None)
    for layer in model.layers:
        bias = layer.attn.expert_bias
        assert bias is layer.attn._parameters["expert_bias"]
        assert bias.device == mesh_device(mesh) and bias.dtype == FP32
    full = fp32keep.gather_full_state_dict(model)
    for name, value in full.items():
        assert torch.equal(value, source[name].to(value.dtype)), name
    assert full["layers.1.attn.expert_bias"].dtype == FP32
