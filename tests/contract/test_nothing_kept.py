"""A contract that keeps nothing at its dtype says so, and ``expect_kept=N`` fails it.

The toy declares ``_keep_in_fp32_modules = ["wo"]`` (two ``wo`` weights). Transformers applies
the regular list under fp16 only, except 5.0.0, which has no dtype gate
(``docs/transformers-keep-semantics.md``): at bf16 the contract keeps nothing and passes
every row vacuously. The expectation per release line is written here, never read from the plan.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version
from torch.distributed.device_mesh import DeviceMesh

from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import transformers_version
from tests.cli.targets import regular_stack, toy_batch
from tests.error_bounds import LIBRARY_BOUND_S, within

#: 5.0.0 applies the regular list at every dtype; every other supported release under fp16 only.
NO_GATE = Version(transformers_version()).release == (5, 0, 0)
WO = {"layers.0.wo.weight", "layers.1.wo.weight"}
NOTHING = "nothing is kept in FP32 at bfloat16"


@pytest.mark.fsdp2
def test_a_regular_list_at_bf16_keeps_nothing_and_the_report_says_why(
    fsdp2_mesh: DeviceMesh,
) -> None:
    report = assert_fp32_keep_contract(
        regular_stack, toy_batch, mesh=fsdp2_mesh, dtype=torch.bfloat16
    )
    notes = [note for note in report.notes if note.startswith(NOTHING)]
    if NO_GATE:  # the list applies at bf16 too: kept, and no such note
        assert {row.fqn for row in report.kept} == WO and notes == []
        return
    assert report.kept == ()
    (note,) = notes
    version = transformers_version()
    assert f"declares _keep_in_fp32_modules ['wo'], which Transformers {version} applies " in note
    assert "only under float16" in note and "expect_kept=N" in note
    assert note in report.summary()  # the summary pytest users print shows it too


@pytest.mark.fsdp2
def test_the_same_list_at_fp16_keeps_and_has_no_such_note(fsdp2_mesh: DeviceMesh) -> None:
    """Negative control of the note: where the list applies, the report keeps and says nothing."""
    report = assert_fp32_keep_contract(
        regular_stack, toy_batch, mesh=fsdp2_mesh, dtype=torch.float16, expect_kept=2
    )
    assert {row.fqn for row in report.kept} == WO
    assert not any(note.startswith("nothing is kept") for note in report.notes)
    (row,) = [f for f in report.findings if f.check == "kept count"]
    assert row.ok and row.observed == "2" and row.expected == "at least 2 (expect_kept=2)"


@pytest.mark.fsdp2
def test_expect_kept_fails_a_run_that_keeps_fewer(fsdp2_mesh: DeviceMesh) -> None:
    # fp16: two kept in every release; three asked for
    with within(LIBRARY_BOUND_S), pytest.raises(ContractViolation, match="kept count") as fewer:
        assert_fp32_keep_contract(
            regular_stack, toy_batch, mesh=fsdp2_mesh, dtype=torch.float16, expect_kept=3
        )
    (row,) = fewer.value.report.failures
    assert (row.check, row.observed) == ("kept count", "2")
    assert "lower expect_kept" in str(fewer.value)  # what to do
    if NO_GATE:
        return
    # bf16: the vacuous pass of the first test, now a failure naming why
    with pytest.raises(ContractViolation, match="kept count") as none:
        assert_fp32_keep_contract(
            regular_stack, toy_batch, mesh=fsdp2_mesh, dtype=torch.bfloat16, expect_kept=1
        )
    (row,) = none.value.report.failures
    assert row.observed == "0 (nothing kept: see the note)"
    assert any(note.startswith(NOTHING) for note in none.value.report.notes)


def _never_built() -> torch.nn.Module:
    raise AssertionError("the model was built before expect_kept was validated")


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(-1, id="negative"),
        pytest.param(True, id="bool"),
        pytest.param(2.0, id="float"),
        pytest.param("4", id="string"),
    ],
)
def test_a_bad_expect_kept_is_refused_before_anything_is_built(value: object) -> None:
    with (
        within(LIBRARY_BOUND_S),
        pytest.raises(ValueError, match=r"expect_kept=.*expected None or a whole number"),
    ):
        assert_fp32_keep_contract(
            _never_built,
            toy_batch,
            mesh=None,  # type: ignore[arg-type]  # never reached
            dtype=torch.bfloat16,
            expect_kept=value,  # type: ignore[arg-type]
        )
