"""The contract's modes for frameworks' other set-ups (issue 34): frozen models judged forward
only, and loaders that take the full state dict on every rank."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fp32keep
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
from pytest_fp32keep.contract.checks.parity import FORWARD_ONLY
from tests.multirank.test_policies_fsdp2 import kept_units_with

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

FP16 = torch.float16
T5 = ZOO["t5"]


def frozen_t5() -> nn.Module:
    """T5 as a reference or teacher model: every parameter frozen (trl's `prepare_fsdp`)."""
    model = T5.build()
    model.requires_grad_(False)
    return model


def _contract(factory: object, mesh: DeviceMesh, **options: object) -> ContractReport:
    return assert_fp32_keep_contract(
        factory,  # type: ignore[arg-type]
        functools.partial(T5.make_batch, seed=0),
        mesh=mesh,
        dtype=FP16,
        **options,  # type: ignore[arg-type]
    )


def test_a_frozen_model_is_judged_forward_only(mesh: DeviceMesh) -> None:
    report = _contract(frozen_t5, mesh)
    assert FORWARD_ONLY in report.notes
    assert {f.subject for f in report.findings if f.check == "parity"} == {"logits", "loss"}
    assert {row.materialized for row in report.kept} == {"float32"}  # still all-gathered: seen


def test_a_frozen_model_still_fails_a_wrong_keep(mesh: DeviceMesh) -> None:
    # the negative control: forward only still judges the all-gather and the forward
    callers_policy_on_kept_units = kept_units_with(lambda policy: policy)
    with pytest.raises(ContractViolation) as caught:
        _contract(frozen_t5, mesh, shard=callers_policy_on_kept_units, autocast=True)
    failed = {f.check for f in caught.value.report.failures}
    assert "materialized" in failed, caught.value.report.failures
    assert FORWARD_ONLY in caught.value.report.notes


def test_a_trainable_model_is_not_forward_only(mesh: DeviceMesh) -> None:
    report = _contract(T5.build, mesh)
    assert FORWARD_ONLY not in report.notes
    assert any(
        f.subject.startswith("grad ") or f.subject == "every gradient" for f in report.findings
    )


def load_every_rank(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """A loader that reads the whole dict on each rank (nemo-automodel's): every rank refuses
    when any rank has none (agreed first, so no rank waits in a collective its peer left), then
    it hands rank 0's to fp32keep's loader."""
    everywhere = torch.tensor([int(state_dict is not None)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not everywhere.item():
        raise ValueError("a rank got no state dict")
    fp32keep.load_full_state_dict(model, state_dict if dist.get_rank() == 0 else None)


def test_a_loader_may_take_the_dict_on_every_rank(mesh: DeviceMesh) -> None:
    report = _contract(T5.build, mesh, load=load_every_rank, load_on_every_rank=True)
    assert report.ok
    assert any(f.check == "round trip" for f in report.findings)


def test_without_the_option_the_other_ranks_get_none(mesh: DeviceMesh) -> None:
    # the negative control: the same loader, the default hand-over: rank 1 gets None
    with pytest.raises(ContractViolation) as caught:
        _contract(T5.build, mesh, load=load_every_rank)
    crashed = [f for f in caught.value.report.failures if f.check == "crashed"]
    assert [f.subject for f in crashed] == ["load"], crashed
    assert "a rank got no state dict" in crashed[0].observed


def test_a_non_bool_load_on_every_rank_is_refused(mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match=r"load_on_every_rank='yes'"):
        _contract(T5.build, mesh, load_on_every_rank="yes")
