"""Frameworks' own set-ups the contract must judge (issue 34): a gradient scale other than
FSDP2's mean, declared with ``gradient_divide_factor``, and a mesh the framework builds itself.

The framework here is torchtitan-like: ``fp32keep.apply_fsdp2``, then every FSDP2 unit divides
the summed gradient by its own factor (torchtitan's ``disable_fsdp_gradient_division`` sets 1.0:
a sum, the loss scaled by the token count instead) and forces sum reductions, which gloo needs
(it has no ``PREMUL_SUM``). The models are the zoo's GPT-OSS at fp16 (its norms kept in FP32) and
T5, whose gradients only the parity control bounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import fp32keep
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
from tests.error_bounds import LIBRARY_BOUND_S, within
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.multirank.test_policies_fsdp2 import kept_units_with

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

FP16 = torch.float16

#: Every rank raises the same error within the library bound (tests/multirank/refusals.py).
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def dividing_by(factor: float, *, force_sum: bool = True) -> Callable[..., None]:
    """A torchtitan-like ``shard``: fp32keep's wrapping, then every unit divides the summed
    gradient by ``factor`` (sum reductions forced, as gloo needs, unless ``force_sum=False``)."""

    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: fp32keep.KeepPlan,
        wrap: fp32keep.WrapSpec | None,
        observed: fp32keep.ParameterUse | None = None,
    ) -> None:
        fp32keep.apply_fsdp2(
            model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap, observed=observed
        )
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(factor)
                module.set_force_sum_reduction_for_comms(force_sum)

    return shard


def _contract(mesh: DeviceMesh, model: str = "gpt_oss", **options: Any) -> ContractReport:
    """The contract on zoo ``model`` at fp16, with ``options``."""
    entry, batch = ZOO[model], functools.partial(ZOO[model].make_batch, seed=0)
    return assert_fp32_keep_contract(entry.build, batch, mesh=mesh, dtype=FP16, **options)


def _gradient_failures(caught: pytest.ExceptionInfo[ContractViolation]) -> list[str]:
    failures = caught.value.report.failures
    assert failures, caught.value.report
    assert {f.check for f in failures} == {"parity"}, failures  # nothing but the scale is wrong
    assert all(f.subject not in ("logits", "loss") for f in failures), failures
    return [f.subject for f in failures]


#: GPT-OSS's gradients are bit-identical to the reference's; T5's are not (its shared position
#: bias accumulates in another order), so there the control, summing too, bounds them.
MODELS = pytest.mark.parametrize("model", ["gpt_oss", "t5"])


@MODELS
def test_a_summing_framework_passes_with_its_factor_declared(mesh: DeviceMesh, model: str) -> None:
    report = _contract(mesh, model, shard=dividing_by(1.0), gradient_divide_factor=1.0)
    assert report.ok
    assert any(f.check == "parity" and f.subject != "logits" for f in report.findings)


@MODELS
def test_a_summing_framework_without_the_declaration_fails_parity_on_gradients(
    mesh: DeviceMesh, model: str
) -> None:
    # the negative control: FSDP2's mean expected, the sum over 2 ranks (2x) observed
    with pytest.raises(ContractViolation) as caught:
        _contract(mesh, model, shard=dividing_by(1.0))
    assert _gradient_failures(caught)


@MODELS
def test_a_declared_sum_fails_on_fsdp2s_mean(mesh: DeviceMesh, model: str) -> None:
    # the declaration does not match the implementation: a sum declared, FSDP2's mean observed
    # (on T5 only a control summing as declared keeps the bound tight enough to see it)
    with pytest.raises(ContractViolation) as caught:
        _contract(mesh, model, gradient_divide_factor=1.0)
    assert _gradient_failures(caught)


def test_a_factor_that_rounds_is_bounded_by_the_control(mesh: DeviceMesh) -> None:
    # world_size / 3 is no power of two: FSDP2's division rounds, and so does the control's
    report = _contract(mesh, shard=dividing_by(3.0), gradient_divide_factor=3.0)
    assert report.ok
    with pytest.raises(ContractViolation) as caught:  # and a factor off by one is caught
        _contract(mesh, shard=dividing_by(3.0), gradient_divide_factor=4.0)
    assert _gradient_failures(caught)


def test_a_factor_without_sum_reductions_on_gloo_is_a_crashed_backward(mesh: DeviceMesh) -> None:
    # FSDP2 applies the factor as PREMUL_SUM, which gloo does not have: the framework's bug,
    # reported as its crash (the contract's own control forces sum reductions on gloo)
    if dist.get_backend() != "gloo":
        pytest.skip("NCCL has PREMUL_SUM: nothing crashes there")
    with (
        within(LIBRARY_BOUND_S),
        pytest.raises(ContractViolation) as caught,
    ):
        _contract(mesh, shard=dividing_by(1.0, force_sum=False), gradient_divide_factor=1.0)
    crashed = [f for f in caught.value.report.failures if f.check == "crashed"]
    assert [f.subject for f in crashed] == ["backward"], caught.value.report.failures
    assert "PREMUL_SUM with Gloo" in crashed[0].observed


def device_type() -> str:
    """The ranks' device type: CUDA under NCCL (ci/gpu-check), else the CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def framework_mesh(shape: str) -> DeviceMesh:
    """The mesh a framework builds itself (torchtitan's and accelerate's dimension names)."""
    world = dist.get_world_size()
    if shape == "1-D":
        return init_device_mesh(device_type(), (world,), mesh_dim_names=("dp_shard",))
    names = ("dp_replicate", "dp_shard")
    two = init_device_mesh(device_type(), (1, world), mesh_dim_names=names)
    return two["dp_shard"] if shape == "dp_shard of 2-D" else two


@pytest.mark.parametrize("shape", ["1-D", "dp_shard of 2-D", "2-D (HSDP)"])
def test_a_mesh_the_framework_builds(shape: str) -> None:
    mesh = framework_mesh(shape)
    report = _contract(mesh)
    assert report.ok
    assert {row.stored for row in report.kept} == {"float32"}


def test_a_mesh_the_framework_builds_still_fails_a_wrong_keep() -> None:
    # the negative control: the caller's fp16 policy on the kept units, on the framework's mesh
    with pytest.raises(ContractViolation) as caught:
        _contract(framework_mesh("dp_shard of 2-D"), shard=kept_units_with(lambda p: p))
    assert "materialized" in {f.check for f in caught.value.report.failures}


def _never_built() -> nn.Module:
    raise AssertionError("the model was built before the mesh was validated")


def test_a_3d_mesh_is_refused_naming_the_mesh_before_anything_is_built() -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh(
        device_type(), (1, 1, world), mesh_dim_names=("pp", "dp_replicate", "dp_shard")
    )
    error = refused_on_every_rank(
        lambda: assert_fp32_keep_contract(_never_built, lambda _: None, mesh=mesh, dtype=FP16),
        ValueError,
        rf"mesh=\.\.\.\): got a 3-D mesh of shape \(1, 1, {world}\) named \('pp', 'dp_replicate', "
        r"'dp_shard'\); FSDP2 shards on a 1-D mesh",
    )
    assert "mesh['dp_shard']" in str(error)
