"""Two-rank scenarios for assert_fp32_keep_contract: it passes on fp32keep, fails on wrong fixes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fp32keep import KeepPlan
from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from tests.core.toys import stack_class

BF16, FP16 = torch.bfloat16, torch.float16


def factory() -> nn.Module:
    return stack_class(strict=["wo", "norm"])()


def batch(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))


def scenario_contract_holds_in_every_context(mesh: DeviceMesh) -> None:
    for dtype, autocast, prefetch in itertools.product((BF16, FP16), (False, True), (False, True)):
        report = assert_fp32_keep_contract(
            factory, batch, mesh=mesh, dtype=dtype, autocast=autocast, forward_prefetch=prefetch
        )
        assert report.ok
        assert {row.stored for row in report.kept} == {"float32"}


def scenario_negative_control_fp32_param_dtype_breaks_the_boundary(mesh: DeviceMesh) -> None:
    def wrong_shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: object,
    ) -> None:
        for layer in model.layers:
            for name in ("wo", "input_layernorm", "post_attention_layernorm"):
                fully_shard(
                    getattr(layer, name),
                    mesh=mesh,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32),
                )
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(
            model.norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32)
        )
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    with pytest.raises(ContractViolation, match="boundary") as error:
        assert_fp32_keep_contract(
            factory, batch, mesh=mesh, dtype=BF16, autocast=True, shard=wrong_shard
        )
    assert "layers.0.input_layernorm" in str(error.value)
