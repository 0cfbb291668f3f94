"""Every zoo model runs the full contract in two ranks, or is refused where FSDP2 cannot keep it.

Entries missing from the installed Transformers (Afmoe before 5.x) skip with the reason, decided
in the parent before any rank starts. The default tier runs every entry at both dtypes with a unit
per kept module, and the model-wide kept unit (``group_kept="model"``) on the entries of
:data:`MODEL_WIDE_DEFAULT`; the slow tier runs the model-wide unit on every entry too.

Every contract here runs with every warning an error, as under ``-W error``: torch's warning
about the contract's own FSDP2 units returning views must not crash it (the inner sessions of
``tests/contract/test_contract_warnings.py`` run the same with the real options).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from fp32keep import KeepLayoutError, apply_fsdp2
from pytest_fp32keep import assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO, ZooEntry, available_entries

AVAILABILITY = available_entries()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The model-wide kept unit in the default tier: an encoder-decoder keeping large matrices (T5's
#: `wo`, fp16), a strict router list (Ernie4.5-MoE, bf16), every norm of a decoder (GptOss, fp16).
MODEL_WIDE_DEFAULT = frozenset({("t5", "fp16"), ("ernie4_5_moe", "bf16"), ("gpt_oss", "fp16")})
LAYOUTS = {"unit-per-kept-module": False, "model-wide-kept-unit": "model"}


def case(name: str, dtype: str, layout: str) -> object:
    marks = []
    if name in AVAILABILITY.unavailable:
        marks.append(pytest.mark.skip(reason=AVAILABILITY.unavailable[name]))
    if LAYOUTS[layout] and (name, dtype) not in MODEL_WIDE_DEFAULT:
        marks.append(pytest.mark.slow)
    return pytest.param(name, dtype, LAYOUTS[layout], id=f"{name}-{dtype}-{layout}", marks=marks)


@pytest.mark.fsdp2
@pytest.mark.parametrize(
    ("name", "dtype", "group_kept"),
    [case(n, d, layout) for layout in LAYOUTS for n in ZOO for d in DTYPES],
)
def test_zoo_model_keeps_the_contract(
    fsdp2_mesh: DeviceMesh, name: str, dtype: str, group_kept: bool | str
) -> None:
    entry: ZooEntry = ZOO[name]
    low = DTYPES[dtype]
    shard = {"shard": functools.partial(apply_fsdp2, group_kept="model")} if group_kept else {}

    def run() -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # as -W error: the user's filters, at their strictest
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
