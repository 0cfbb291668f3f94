"""Gradient parity is right at every world size: no false failure, and real losses still fail.

Averaging a gradient over ``N`` ranks is exact only for some ``N`` and dtypes: at 3 ranks
Ernie4_5_Moe's kept FP32 router gradient lands 5.6e-8 away from the unsharded model's, at 8
GptOss's kept norms under fp16 about 9e-8; both used to fail ``parity`` against a bound of 0 from
a plain-FSDP2 control. The bound now comes from a control with the implementation's own units at
the same world size (``pytest_fp32keep.contract.control``, argued in docs/contract.md), so
fp32keep passes at 1, 2, 3, 4 and 8 ranks, while the two negative controls fail ``parity`` at
every one of them, naming a kept gradient:

* kept gradients scaled by ``1 + 2**-10`` (a precision loss far below bf16's roundoff);
* kept units reducing their FP32 gradients in bf16 instead of the caller's FP32.

The default suite runs the 3-rank slice (an odd world size, the known false failure); the full
sweep is in the slow tier (``pytest --slow``, tests/conftest.py; ``nox -s world-sizes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep.shard.apply
from fp32keep import KeepPlan, WrapSpec, apply_fsdp2
from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO, available_entries
from pytest_fp32keep.contract.control import unit_layout
from tests.contract.wrong import scaled_kept_gradients

AVAILABILITY = available_entries()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WORLD_SIZES = (1, 2, 3, 4, 8)
#: (zoo model, dtype): the two known false failures (ernie at 3 ranks, gpt_oss fp16 at 8).
MODELS = (("ernie4_5_moe", "bf16"), ("gpt_oss", "fp16"))


def bf16_reduction(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """fp32keep's layout and wrapping, with every kept unit's policy made to reduce its FP32
    gradients in bf16 although the caller's policy says FP32: ``apply_fsdp2`` with its kept-unit
    policy (``fp32keep.shard.apply.kept_unit_policy``) swapped for a wrong one, so each kept unit is
    sharded ``fully_shard(kept, mp_policy=...(reduce_dtype=bf16))`` on exactly fp32keep's layout
    (public torch API only; FSDP2 itself is not touched)."""
    correct = fp32keep.shard.apply.kept_unit_policy
    calls: list[MixedPrecisionPolicy] = []

    def reducing_in_bf16(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
        calls.append(policy)
        return dataclasses.replace(correct(policy), reduce_dtype=torch.bfloat16)

    with mock.patch.object(fp32keep.shard.apply, "kept_unit_policy", reducing_in_bf16):
        apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)
    kept_units = [u for u in unit_layout(model) if u.params and all(n in plan for n in u.params)]
    assert calls and kept_units, "the negative control found no kept unit to break"


IMPLEMENTATIONS: dict[str, Callable[..., None] | None] = {
    "fp32keep": None,
    "scaled-kept-gradients": scaled_kept_gradients,
    "bf16-reduction": bf16_reduction,
}


def _check(mesh: DeviceMesh, name: str, dtype: str, implementation: str) -> None:
    entry = ZOO[name]
    shard = IMPLEMENTATIONS[implementation]

    def run() -> object:
        return assert_fp32_keep_contract(
            entry.build,
            lambda model: entry.make_batch(model, 0),
            mesh=mesh,
            dtype=DTYPES[dtype],
            autocast=True,
            check_state_dict=False,  # the round trip is not what this sweep is about
            **({"shard": shard} if shard else {}),
        )

    if shard is None:
        run()
        return
    with pytest.raises(ContractViolation) as caught:
        run()
    report = caught.value.report
    status = report.status()
    assert not status["parity"], report.table()
    assert all(ok for check, ok in status.items() if check != "parity"), report.table()
    kept = {f"grad {row.fqn}" for row in report.kept}
    failing = {f.subject for f in report.failures if f.check == "parity"}
    assert failing & kept, f"no kept gradient fails parity: {sorted(failing)}"


def _case(world: int, name: str, dtype: str, implementation: str, *marks: Any) -> Any:
    skip = AVAILABILITY.unavailable.get(name)
    return pytest.param(
        world,
        name,
        dtype,
        implementation,
        id=f"{world}ranks-{name}-{dtype}-{implementation}",
        marks=[pytest.mark.fsdp2(nproc=world), *marks]
        + ([pytest.mark.skip(reason=skip)] if skip else []),
    )


@pytest.mark.parametrize(
    ("world", "name", "dtype", "implementation"),
    [_case(3, "ernie4_5_moe", "bf16", implementation) for implementation in IMPLEMENTATIONS],
)
def test_parity_at_an_odd_world_size(
    fsdp2_mesh: DeviceMesh, world: int, name: str, dtype: str, implementation: str
) -> None:
    assert fsdp2_mesh.size() == world
    _check(fsdp2_mesh, name, dtype, implementation)


@pytest.mark.parametrize(
    ("world", "name", "dtype", "implementation"),
    [
        _case(world, name, dtype, implementation, pytest.mark.slow)
        for world in WORLD_SIZES
        for name, dtype in MODELS
        for implementation in IMPLEMENTATIONS
    ],
)
def test_parity_sweep(
    fsdp2_mesh: DeviceMesh, world: int, name: str, dtype: str, implementation: str
) -> None:
    assert fsdp2_mesh.size() == world
    _check(fsdp2_mesh, name, dtype, implementation)
