"""The torchtitan adapter's two departures from a plain ``shard`` are load-bearing.

``examples/frameworks/torchtitan_fsdp2.py`` declares torchtitan's gradient scale (a sum over the
ranks) and, on gloo, forces sum reductions: the negative controls here show that without the
declaration its gradients fail ``parity`` (2x the mean), and without the forced sums its backward
raises on gloo (no ``PREMUL_SUM``; NCCL has it). Its bad input, an encoder-decoder or a policy
torchtitan cannot build, is refused with an error naming the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.frameworks.torchtitan_fsdp2 import (
    TORCHTITAN_GRADIENT_DIVIDE_FACTOR,
    apply_fsdp_as_torchtitan,
    titan_names,
    torchtitan_policy,
    torchtitan_shard,
)
from fp32keep import KeepPlan, WrapSpec
from pytest_fp32keep import ContractReport, ContractViolation
from pytest_fp32keep.check.zoo import ZOO
from tests.frameworks.harness import on_zoo
from tests.frameworks.observe import rows_of

pytestmark = pytest.mark.slow  # breadth at pinned versions (conftest.py)

FP16 = torch.float16


def _contract(mesh: DeviceMesh, **plugged: Any) -> ContractReport:
    """The contract on GPT-OSS at fp16 under torchtitan's policy over FP32 master weights."""
    policy = torchtitan_policy(FP16)
    return on_zoo(mesh, "gpt_oss", FP16, mp_policy=policy, master_dtype=torch.float32, **plugged)


def _apply_fsdp_as_is(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """torchtitan's ``apply_fsdp`` without the adapter's forced sum reductions."""
    apply_fsdp_as_torchtitan(model, mesh, mp_policy)


@pytest.mark.fsdp2(nproc=2)
def test_undeclared_sum_fails_parity_on_gradients(fsdp2_mesh: DeviceMesh) -> None:
    # torchtitan's units fail GPT-OSS's kept norms either way (materialized, operators); only
    # without the declaration do its summed gradients fail parity too (2x the mean)
    declared = rows_of(
        _failing(fsdp2_mesh, gradient_divide_factor=TORCHTITAN_GRADIENT_DIVIDE_FACTOR)
    )
    undeclared = rows_of(_failing(fsdp2_mesh))
    assert declared == {"materialized (kept)", "operators (kept)"}, declared
    assert undeclared == declared | {"parity (kept)", "parity (not kept)"}, undeclared


@pytest.mark.fsdp2(nproc=2)
def test_without_forced_sums_gloo_crashes_the_backward(fsdp2_mesh: DeviceMesh) -> None:
    rows = rows_of(
        _failing(
            fsdp2_mesh,
            shard=_apply_fsdp_as_is,
            gradient_divide_factor=TORCHTITAN_GRADIENT_DIVIDE_FACTOR,
        )
    )
    # NCCL has PREMUL_SUM: there the forced sums change nothing, and nothing crashes
    assert ("crashed (backward)" in rows) == (dist.get_backend() == "gloo"), rows


def _failing(mesh: DeviceMesh, **plugged: Any) -> ContractReport:
    plugged.setdefault("shard", torchtitan_shard)
    with pytest.raises(ContractViolation) as caught:
        _contract(mesh, **plugged)
    return caught.value.report


def test_an_encoder_decoder_is_refused_naming_what_it_lacks() -> None:
    lacking = r"trains decoders: T5ForConditionalGeneration has no model.embed_tokens"
    with pytest.raises(ValueError, match=lacking), titan_names(ZOO["t5"].build()):
        pass


def test_a_policy_torchtitan_cannot_build_is_refused() -> None:
    casting = MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match="cast_forward_inputs=False"):
        torchtitan_shard(
            ZOO["gpt_oss"].build(),
            mesh=None,
            mp_policy=casting,
            plan=None,
            wrap=None,  # type: ignore[arg-type]
        )
