"""assert_fp32_keep_contract in every rank: it passes on fp32keep and fails on a wrong fix."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import KeepPlan
from fp32keep.plan.compat import installed_semantics
from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from tests.core.toys import stack_class

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

BF16, FP16 = torch.bfloat16, torch.float16


def factory() -> nn.Module:
    return stack_class(strict=["wo", "norm"])()


def toy(**declared: list[str]) -> Callable[[], nn.Module]:
    """A factory for the toy decoder with the given keep declarations."""
    return lambda: stack_class(**declared)()


def batch(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
@pytest.mark.parametrize("autocast", [False, True], ids=["direct", "autocast"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_contract_holds(
    mesh: DeviceMesh, dtype: torch.dtype, autocast: bool, prefetch: bool
) -> None:
    report = assert_fp32_keep_contract(
        factory, batch, mesh=mesh, dtype=dtype, autocast=autocast, forward_prefetch=prefetch
    )
    assert report.ok
    assert {row.stored for row in report.kept} == {"float32"}
    assert {row.materialized for row in report.kept} == {"float32"}
    assert all(report.status().values())


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
@pytest.mark.parametrize("autocast", [False, True], ids=["direct", "autocast"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group_kept", ["block", "model"])
def test_contract_holds_with_grouped_kept_units(
    mesh: DeviceMesh,
    group_kept: fp32keep.layout.planning.KeptGrouping,
    dtype: torch.dtype,
    autocast: bool,
    prefetch: bool,
) -> None:
    report = assert_fp32_keep_contract(
        factory,
        batch,
        mesh=mesh,
        dtype=dtype,
        autocast=autocast,
        forward_prefetch=prefetch,
        shard=functools.partial(fp32keep.apply_fsdp2, group_kept=group_kept),
    )
    assert report.ok
    assert {row.materialized for row in report.kept} == {"float32"}


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_regular_list_follows_the_installed_dtype_gate(
    mesh: DeviceMesh, dtype: torch.dtype
) -> None:
    # fp16 only, except Transformers 5.0.0, which applies the regular list under every dtype.
    gated_in = installed_semantics().applies("regular", dtype)
    report = assert_fp32_keep_contract(toy(regular=["wo"]), batch, mesh=mesh, dtype=dtype)
    assert len(report.kept) == (2 if gated_in else 0)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_strict_list_applies_under_both(mesh: DeviceMesh, dtype: torch.dtype) -> None:
    report = assert_fp32_keep_contract(toy(strict=["wo"]), batch, mesh=mesh, dtype=dtype)
    assert [row.fqn for row in report.kept] == ["layers.0.wo.weight", "layers.1.wo.weight"]
    assert {row.list_kind for row in report.kept} == {"strict"}


def test_parent_child_overlap_and_duplicate_declarations(mesh: DeviceMesh) -> None:
    # `layers` (a ModuleList: resolves to its callable blocks) contains `wo`, declared twice.
    declared = toy(strict=["layers", "wo", "wo"], regular=["wo"])
    report = assert_fp32_keep_contract(declared, batch, mesh=mesh, dtype=FP16, autocast=True)
    assert {row.fqn.split(".")[0] for row in report.kept} == {"layers"}
    assert len(report.kept) == 2 * 7  # every parameter of both blocks


def test_tied_aliases_and_fp32_buffers(mesh: DeviceMesh) -> None:
    def build() -> nn.Module:
        model = stack_class(strict=["wo"])()
        model.head.weight = model.embed.weight  # tied, both in the root unit
        for layer in model.layers:
            layer.wo.register_buffer("scale", torch.linspace(1.0, 2.0, 8))
        return model

    report = assert_fp32_keep_contract(build, batch, mesh=mesh, dtype=BF16, autocast=True)
    kept = {row.fqn: row.stored for row in report.kept}
    assert kept["layers.0.wo.scale"] == "float32"
    round_trip = {f.subject for f in report.findings if f.check == "round trip"}
    assert {"head.weight", "embed.weight", "layers.1.wo.scale"} <= round_trip


def test_round_trip_with_cpu_offload(mesh: DeviceMesh) -> None:
    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: object,
    ) -> None:
        offload = CPUOffloadPolicy(pin_memory=False)
        fp32keep.apply_fsdp2(
            model, mesh=mesh, mp_policy=mp_policy, plan=plan, offload_policy=offload
        )

    def load(model: nn.Module, state_dict: object) -> None:
        fp32keep.load_full_state_dict(model, state_dict, cpu_offload=True)  # type: ignore[arg-type]

    report = assert_fp32_keep_contract(
        factory, batch, mesh=mesh, dtype=BF16, shard=shard, load=load
    )
    assert report.status()["round trip"]


def test_model_without_declarations_gets_plain_fsdp2(mesh: DeviceMesh) -> None:
    report = assert_fp32_keep_contract(toy(), batch, mesh=mesh, dtype=BF16, autocast=True)
    assert report.kept == ()
    assert report.ok


def test_negative_control_fp32_param_dtype_breaks_the_boundary(mesh: DeviceMesh) -> None:
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


def _tied_stack() -> nn.Module:
    model = stack_class(strict=["wo"])()
    model.head.weight = model.embed.weight
    return model


def _shard_tie_apart(tie_again: bool) -> Callable[..., None]:
    """Transformers' layout for a tied embedding (``from_pretrained(..., distributed_config=)``
    in 5.24): untie, give the embedding a unit of its own while the head stays in the root, and,
    if ``tie_again``, tie the head back to the embedding's sharded parameter (FSDP2 adopts it at
    its lazy init, so both units gather and reduce the one parameter)."""

    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: object,
    ) -> None:
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
        kept = dataclasses.replace(mp_policy, param_dtype=None, output_dtype=None)
        for layer in model.layers:
            fully_shard(layer.wo, mesh=mesh, mp_policy=kept)
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model.embed, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        if tie_again:
            model.head.weight = model.embed.weight

    return shard


def test_a_tied_parameter_sharded_in_two_units_is_rebuilt_by_the_control(
    mesh: DeviceMesh,
) -> None:
    # The control must shard the embedding and the head apart and tie them again as the
    # implementation did; one unit holding both (what `params` alone describes) cannot be made
    # to manage the same attributes, and the control would be a `parity (control)` failure.
    report = assert_fp32_keep_contract(
        _tied_stack,
        batch,
        mesh=mesh,
        dtype=BF16,
        autocast=True,
        shard=_shard_tie_apart(tie_again=True),
    )
    assert report.ok, report.table(failures_only=True)
    # Negative control: left untied, the head trains a copy of its own, and the embedding's
    # gradient misses the head's share of it.
    with pytest.raises(ContractViolation) as error:
        assert_fp32_keep_contract(
            _tied_stack,
            batch,
            mesh=mesh,
            dtype=BF16,
            autocast=True,
            shard=_shard_tie_apart(tie_again=False),
        )
    parity = [f for f in error.value.report.findings if not f.ok and f.check == "parity"]
    assert "embed.weight" in {f.subject.removeprefix("grad ") for f in parity}, str(error.value)
    assert not any("control" in f.subject for f in parity), str(error.value)
