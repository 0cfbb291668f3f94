"""What a ContractViolation says to do, by what actually broke (issue 36, item 5).

- a crash is advised by what its error says: FSDP2's ``uniform original parameter dtype``
  assertion (the crash the README opens with) gets the fix for it, a crash of the unsharded
  reference gets the reference's line, and neither line is printed where it does not apply;
- the ``operators`` rows that a ``stored``, ``materialized`` or ``boundary`` failure of the same
  kept module explains fold into one line, as the parity rows do (a blanket cast printed 103
  lines).

The pure tests run here; the ``fsdp2`` one in 2 real torchrun ranks (gloo): a real FSDP2 unit
over mixed dtypes, on the toy decoder.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.contract.report import Finding
from tests.contract.tables import table_rows
from tests.core.toys import stack_class

BF16 = torch.bfloat16
#: Phrases of the uniform-dtype advice: what the crash means, and each way out.
UNIFORM_ADVICE = (
    "mixes FP32 kept parameters with low-precision ones",
    "fp32keep.apply_fsdp2",
    "fp32keep.upcast_to_fp32_master",
    "param_dtype_override_fn",
)
REFERENCE_ADVICE = "the unsharded reference itself failed"


def _message(*findings: Finding) -> str:
    report = ContractReport("Decoder", BF16, "autocast", (), findings)
    return " ".join(str(ContractViolation(report)).split())  # wrapped lines joined


def _advice(*findings: Finding) -> str:
    return _message(*findings).split("what to do:", 1)[1]


# --- crashes: the advice fits the crash ----------------------------------------------------------

UNIFORM_CRASH = Finding(
    "crashed",
    "forward",
    "no exception",
    "AssertionError: FSDP expects uniform original parameter dtype but got "
    "{torch.bfloat16, torch.float32} (ranks [0, 1])",
    False,
)
OTHER_CRASH = Finding("crashed", "shard", "no exception", "RuntimeError: boom (rank 1)", False)
REFERENCE_CRASH = Finding(
    "crashed",
    "reference",
    "no exception",
    "NonFiniteReference: grad gain holds NaN in torch.bfloat16 (ranks [0, 1])",
    False,
)


def test_the_uniform_dtype_crash_gets_its_own_fix() -> None:
    advice = _advice(UNIFORM_CRASH)
    for phrase in UNIFORM_ADVICE:
        assert phrase in advice, (phrase, advice)
    assert REFERENCE_ADVICE not in advice  # the forward crashed, not the reference
    # negative control: another crash gets neither the uniform-dtype fix nor the reference's
    other = _advice(OTHER_CRASH)
    assert not [phrase for phrase in UNIFORM_ADVICE if phrase in other], other
    assert REFERENCE_ADVICE not in other
    assert "its error is in the observed cell" in other


def test_the_reference_line_only_where_the_reference_crashed() -> None:
    advice = _advice(REFERENCE_CRASH)
    assert REFERENCE_ADVICE in advice
    # the implementation's steps did not run: their advice does not apply
    assert "a step of the implementation under test raised" not in advice
    # two crashes of different kinds (rows of two tests, as `fp32keep check` merges none): one
    # line each, the reference's and the step's
    both = _advice(OTHER_CRASH, REFERENCE_CRASH)
    assert REFERENCE_ADVICE in both and "a step of the implementation under test raised" in both
    assert both.count("crashed:") == 2


def test_a_layout_refusal_from_shard_points_to_the_layout_rows() -> None:
    refusal = Finding(
        "crashed",
        "shard",
        "no exception",
        "KeepLayoutError: FSDP2 cannot keep the FP32 contract of Toy: 1 problem(s) (root-owned)",
        False,
    )
    assert "docs/errors.md, rows L1-L6" in _advice(refusal)
    assert "docs/errors.md" not in _advice(OTHER_CRASH)  # negative control


def _mixed_dtype_unit(
    model: nn.Module, *, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, **_: object
) -> None:
    """The naive sharding: one FSDP2 unit over the keep-aware cast model (bf16 and FP32
    parameters together), which FSDP2 refuses at the first forward."""
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def factory() -> nn.Module:
    return stack_class(strict=["wo", "norm"])()


def batch(model: nn.Module) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))}


@pytest.mark.fsdp2
def test_a_real_uniform_dtype_crash_is_advised_with_its_fix(fsdp2_mesh: DeviceMesh) -> None:
    with pytest.raises(ContractViolation) as raised:
        assert_fp32_keep_contract(
            factory, batch, mesh=fsdp2_mesh, dtype=BF16, shard=_mixed_dtype_unit
        )
    crashed = [f for f in raised.value.report.failures if f.check == "crashed"]
    # one row per distinct message: torch prints the dtypes as a set, whose order may differ
    # between the ranks
    assert {f.subject for f in crashed} == {"forward"}, raised.value.report.failures
    assert "uniform original parameter dtype" in crashed[0].observed
    advice = " ".join(str(raised.value).split("what to do:", 1)[1].split())
    for phrase in UNIFORM_ADVICE:
        assert phrase in advice, (phrase, advice)
    assert REFERENCE_ADVICE not in advice


# --- operators rows that follow from stored ------------------------------------------------------

#: A blanket ``model.to(bf16)`` of two kept modules: both weights stored low, so every operator
#: inside them computes low; one more operators row in a module whose tensors are fine.
KEPT = ("layers.0.wo", "layers.1.wo")
BLANKET = (
    *(Finding("stored", f"{module}.weight", "float32", "bfloat16", False) for module in KEPT),
    *(
        Finding(
            "operators",
            f"{module} call 0 op #{op} aten.mm.default",
            "inputs (float32, float32) -> float32",
            "inputs (bfloat16, bfloat16) -> bfloat16",
            False,
        )
        for module in KEPT
        for op in range(4)
    ),
)
UNRELATED = Finding(
    "operators",
    "layers.0.norm call 0 op #0 aten.mul.Tensor",
    "inputs (float32, float32) -> float32",
    "inputs (float32, bfloat16) -> bfloat16",
    False,
)


def test_operators_rows_explained_by_stored_fold_into_one_line() -> None:
    report = ContractReport("Decoder", BF16, "autocast", (), (*BLANKET, UNRELATED))
    text = str(ContractViolation(report))
    rows = table_rows(text.split("what to do:")[0])
    assert [(row["check"], row["subject"]) for row in rows] == [
        ("stored", "layers.0.wo.weight"),
        ("stored", "layers.1.wo.weight"),
        # negative control: norm's tensors were stored right: its operators row is a cause
        ("operators", "layers.0.norm call 0 op #0 aten.mul.Tensor"),
    ], text
    joined = " ".join(text.split())
    assert (
        "8 operators rows follow from the stored failure above (2 kept modules: layers.0.wo, "
        "layers.1.wo)" in joined
    ), text
    assert "operators" in joined.split("): ", 1)[1].split("check")[0]  # still in the headline
    assert len(report.failures) == 11  # every row kept in the report
    assert max(len(line) for line in text.splitlines()) <= 88


def test_operators_rows_fold_under_a_boundary_failure_of_their_module() -> None:
    boundary = Finding("boundary", "layers.0.wo call 0 input args[0]", "float32", "bfloat16", False)
    report = ContractReport("Decoder", BF16, "autocast", (), (boundary, *BLANKET[2:6]))
    text = " ".join(str(ContractViolation(report)).split())
    assert "4 operators rows follow from the boundary failure above (1 kept module" in text
    # negative control: with nothing else failing, the operators rows are the cause: all shown
    alone = str(ContractViolation(ContractReport("D", BF16, "autocast", (), BLANKET[2:])))
    assert "follow from" not in alone
    assert len(re.findall(r"^operators\s", alone, flags=re.M)) == 8
