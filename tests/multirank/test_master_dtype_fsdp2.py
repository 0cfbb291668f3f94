"""``master_dtype=torch.float32``: the contract judges FP32 master weights, in every rank.

Under FP32 master weights (accelerate, verl's default, torchtitan) every trainable parameter is
stored in FP32 and the policy's ``param_dtype`` casts it for compute. fp32keep's own
``upcast_to_fp32_master`` must pass under that convention and fail under the default one, and
the two known framework bugs must still fail where they break the contract: non-kept parameters
stored in bf16 (``stored``) and kept parameters all-gathered in bf16 (``materialized``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import KeepPlan
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO, available_entries
from tests.core.toys import stack_class

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def factory() -> nn.Module:
    return stack_class(strict=["wo", "norm"])()


def batch(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))


def fp32_master(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """fp32keep's keep-aware cast, then its accelerate-style FP32 master upcast."""
    fp32keep.keep_aware_cast(model, dtype, plan=plan)
    fp32keep.upcast_to_fp32_master(model)


def keep_aware_only(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The known-wrong cast under FP32 master weights: what the plan does not keep stays bf16."""
    fp32keep.keep_aware_cast(model, dtype, plan=plan)


def one_policy_per_block(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: object,
) -> None:
    """accelerate / Transformers 5.24 style: every unit gets the caller's bf16 policy, kept
    modules included, so kept parameters are all-gathered in bf16."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


@pytest.mark.parametrize(
    ("dtype", "autocast"), [(BF16, True), (FP16, False)], ids=["bf16-autocast", "fp16-direct"]
)
def test_fp32keep_master_weights_keep_the_contract(
    mesh: DeviceMesh, dtype: torch.dtype, autocast: bool
) -> None:
    report = assert_fp32_keep_contract(
        factory, batch, mesh=mesh, dtype=dtype, autocast=autocast, master_dtype=FP32
    )
    assert report.ok
    assert {row.stored for row in report.kept} == {"float32"}
    assert {row.materialized for row in report.kept} == {"float32"}
    trip = {f.subject: f.expected for f in report.findings if f.check == "round trip"}
    assert trip["embed.weight"] == "float32"  # the master's dtype wins over the bf16 checkpoint


def test_upcast_to_fp32_master_passes_only_under_the_master_convention(mesh: DeviceMesh) -> None:
    assert assert_fp32_keep_contract(
        factory, batch, mesh=mesh, dtype=BF16, cast=fp32_master, master_dtype=FP32
    ).ok
    with pytest.raises(ContractViolation) as error:  # judged as low-precision storage
        assert_fp32_keep_contract(factory, batch, mesh=mesh, dtype=BF16, cast=fp32_master)
    assert not error.value.report.status()["stored"]


def test_non_kept_parameters_in_bf16_fail_stored_under_master_weights(mesh: DeviceMesh) -> None:
    with pytest.raises(ContractViolation) as error:
        assert_fp32_keep_contract(
            factory, batch, mesh=mesh, dtype=BF16, cast=keep_aware_only, master_dtype=FP32
        )
    report = error.value.report
    stored = {f.subject: (f.expected, f.observed) for f in report.failures if f.check == "stored"}
    assert stored["embed.weight"] == ("float32", "bfloat16")
    assert stored["layers.0.attn.weight"] == ("float32", "bfloat16")
    assert not any(name in stored for name in ("norm.weight", "layers.0.wo.weight"))  # kept: ok
    # the round trip's destination is the convention's FP32 master, not the model's own bf16
    trip = {f.subject: (f.expected, f.observed) for f in report.failures if f.check == "round trip"}
    assert trip["embed.weight"] == ("float32", "bfloat16")
    assert "layers.0.wo.weight" not in trip


@pytest.mark.skipif(
    "ernie4_5_moe" in available_entries(["ernie4_5_moe"]).unavailable,
    reason="Ernie4.5-MoE is not in the installed Transformers",
)
def test_ernie_master_weights_are_judged_by_the_convention(mesh: DeviceMesh) -> None:
    """The real Ernie4.5-MoE (bf16): its trainable parameters left in bf16 fail ``stored`` and
    ``round trip``, each named with FP32 expected; upcast to FP32 masters it passes."""
    entry = ZOO["ernie4_5_moe"]

    def check(cast: Callable[[nn.Module, torch.dtype, KeepPlan], None]) -> ContractReport:
        return assert_fp32_keep_contract(
            entry.build,
            lambda model: entry.make_batch(model, 0),
            mesh=mesh,
            dtype=BF16,
            autocast=True,
            cast=cast,
            master_dtype=FP32,
        )

    with pytest.raises(ContractViolation) as error:
        check(keep_aware_only)
    failures = error.value.report.failures
    # The experts' parameters are named by release (4.56: one Linear per expert; 5.x: fused).
    expert = next(n for n, _ in entry.build().named_parameters() if ".mlp.experts." in n)
    for row in ("stored", "round trip"):
        found = {f.subject: (f.expected, f.observed) for f in failures if f.check == row}
        for name in (
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            expert,
            "model.norm.weight",
        ):
            assert found.get(name) == ("float32", "bfloat16"), (row, name)
        assert not any(".mlp.gate." in name for name in found), row  # kept: FP32, right
    assert check(fp32_master).ok


def test_kept_parameters_gathered_in_bf16_fail_materialized_under_master_weights(
    mesh: DeviceMesh,
) -> None:
    with pytest.raises(ContractViolation) as error:
        assert_fp32_keep_contract(
            factory,
            batch,
            mesh=mesh,
            dtype=BF16,
            autocast=True,
            cast=fp32_master,
            shard=one_policy_per_block,
            master_dtype=FP32,
        )
    report = error.value.report
    gathered = {
        f.subject.split(" ")[0]: f.observed for f in report.failures if f.check == "materialized"
    }
    assert gathered["layers.0.wo.weight"] == "bfloat16"
    assert gathered["norm.weight"] == "bfloat16"
    assert report.status()["stored"]  # everything is stored right: FP32 masters
