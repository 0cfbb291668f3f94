"""FP32 master storage judged on the real families of issue 22 (Voxtral, Kyutai STT, Apertus 1.5).

Issue 22 asks for the master-storage row on these families as well as on Ernie4.5-MoE
(tests/multirank/test_master_dtype_fsdp2.py). Under ``master_dtype=torch.float32`` a cast that
leaves the trainable parameters the plan does not keep in bf16 must fail ``stored`` and ``round
trip``, naming exactly those parameters with FP32 expected (kept and frozen ones are right as
they are); the same family upcast to FP32 masters passes: the negative control that the rows
fail for the cast, not for the family. Voxtral is the default tier's family; the others are
``slow`` (Apertus 1.5 needs Transformers >= 5.24).

Issue 38 asks the same of the families refused over low-precision storage (``mixed-unit``): over
FP32 masters on torch >= 2.15 they pass (Transformers >= 5.25 has them; they skip elsewhere).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fp32keep
from fp32keep import KeepLayoutError, KeepPlan
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.families import entries
from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.contract.steps import CastFn
from tests.multirank.test_keep_policy_fsdp2 import NEEDS_OVERRIDE

pytestmark = pytest.mark.fsdp2

BF16, FP32 = torch.bfloat16, torch.float32


def fp32_master(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The right cast under the master convention: keep-aware, then FP32 master weights."""
    fp32keep.keep_aware_cast(model, dtype, plan=plan)
    fp32keep.upcast_to_fp32_master(model)


def keep_aware_only(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The known-wrong cast under FP32 master weights: what the plan does not keep stays bf16."""
    fp32keep.keep_aware_cast(model, dtype, plan=plan)


def family(name: str, *marks: pytest.MarkDecorator) -> Any:
    present = importlib.util.find_spec(f"transformers.models.{name}") is not None
    skip = pytest.mark.skipif(not present, reason=f"this Transformers release has no {name}")
    return pytest.param(name, marks=[skip, *marks], id=name)


def batch(model: nn.Module) -> dict[str, Any]:
    inputs: dict[str, Any] = family_batch(model, 0)
    return inputs


@pytest.mark.parametrize(
    "name",
    [
        family("voxtral"),
        family("kyutai_speech_to_text", pytest.mark.slow),
        family("apertus1p5", pytest.mark.slow),
    ],
)
def test_master_storage_is_judged_on_the_family(name: str, mesh: DeviceMesh) -> None:
    build = functools.partial(entries.build_family_model, name)

    def check(cast: CastFn) -> ContractReport:
        return assert_fp32_keep_contract(
            build, batch, mesh=mesh, dtype=BF16, autocast=True, cast=cast, master_dtype=FP32
        )

    model = build()
    plan = fp32keep.resolve_keep_plan(model, BF16)
    masters = {
        name
        for name, param in model.named_parameters(remove_duplicate=False)
        if param.requires_grad and param.is_floating_point() and name not in plan.param_names
    }
    assert masters, "the family has no trainable parameter outside its keep list"
    with pytest.raises(ContractViolation) as error:
        check(keep_aware_only)
    failures = error.value.report.failures
    for row in ("stored", "round trip"):
        found = {f.subject: (f.expected, f.observed) for f in failures if f.check == row}
        assert set(found) == masters, (row, sorted(set(found) ^ masters)[:8])
        assert set(found.values()) == {("float32", "bfloat16")}, row
    assert check(fp32_master).ok  # negative control: the same family with FP32 masters passes


@NEEDS_OVERRIDE
@pytest.mark.parametrize(
    "name",
    [
        family("glm5_next", pytest.mark.slow),
        family("inkling", pytest.mark.slow),
        family("kimi_linear", pytest.mark.slow),
    ],
)
def test_a_mixed_unit_family_is_kept_by_policy_over_fp32_masters(
    name: str, mesh: DeviceMesh
) -> None:
    """The families refused over low-precision storage (a kept parameter beside one that is not
    in one module, ``mixed-unit``; pytest_fp32keep/check/families/refusals.py) pass the whole
    contract over FP32 masters on torch >= 2.15, where ``apply_fsdp2`` keeps them by policy in
    the caller's units (``--master-dtype fp32`` in docs/families.md). The negative control: the
    same family over low-precision storage is still refused, naming the mixed unit."""
    build = functools.partial(entries.build_family_model, name)
    contract = functools.partial(
        assert_fp32_keep_contract, build, batch, mesh=mesh, dtype=BF16, autocast=True
    )
    report = contract(master_dtype=FP32)
    assert report.ok and report.kept
    with pytest.raises(KeepLayoutError, match=r"\[mixed-unit\]"):
        contract()
