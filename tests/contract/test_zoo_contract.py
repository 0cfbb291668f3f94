"""Every zoo model runs the full contract in two ranks, or is refused where FSDP2 cannot keep it.

Entries missing from the installed Transformers (Afmoe before 5.x) skip with the reason, decided
in the parent before any rank starts.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from fp32keep import KeepLayoutError, apply_fsdp2
from pytest_fp32keep import assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO, ZooEntry, available_entries

AVAILABILITY = available_entries()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def case(name: str, dtype: str) -> object:
    marks = []
    if name in AVAILABILITY.unavailable:
        marks.append(pytest.mark.skip(reason=AVAILABILITY.unavailable[name]))
    return pytest.param(name, dtype, id=f"{name}-{dtype}", marks=marks)


@pytest.mark.fsdp2
@pytest.mark.parametrize(
    "group_kept", [False, "model"], ids=["unit-per-kept-module", "model-wide-kept-unit"]
)
@pytest.mark.parametrize(("name", "dtype"), [case(n, d) for n in ZOO for d in DTYPES])
def test_zoo_model_keeps_the_contract(
    fsdp2_mesh: DeviceMesh, name: str, dtype: str, group_kept: bool | str
) -> None:
    entry: ZooEntry = ZOO[name]
    low = DTYPES[dtype]
    shard = {"shard": functools.partial(apply_fsdp2, group_kept="model")} if group_kept else {}

    def run() -> object:
        return assert_fp32_keep_contract(
            entry.build,
            lambda model: entry.make_batch(model, 0),
            mesh=fsdp2_mesh,
            dtype=low,
            autocast=True,
            **shard,  # type: ignore[arg-type]
        )

    # Where a refusal is due comes from the zoo's written table per release line and dtype
    # (5.0.0 has no gate), never from the plan under test.
    if low in entry.refused_under():
        with pytest.raises(KeepLayoutError) as error:
            run()
        assert error.value.problems, "a refusal must name the tensors"
        return
    report = run()
    assert report.ok  # type: ignore[attr-defined]
