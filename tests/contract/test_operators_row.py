"""The ``operators`` row: its message shows what was compared, and a kept bf16 matmul fails it.

The row compares, call by call, the aten operators run inside each kept module with their input
and output dtypes. It used to print only each operator's output dtypes, cut at 70 characters: an
FP32 operator fed a bf16 input (type promotion hands back FP32) printed the same expected and
observed text and said FAIL. Now each differing operator is a finding of its own that names the
module, the call, the operator and both sides' input and output dtypes, and the table wraps
long cells instead of cutting them.

The negative control (2 gloo ranks): fp32keep's sharding, storage and all-gather, but each kept
``wo`` computes its matmul on bf16 casts of its FP32 input and weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep import KeepPlan, WrapSpec, apply_fsdp2
from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.contract.checks.boundary import check_operators, diff_operators
from pytest_fp32keep.contract.probe import DtypeProbe, OpDtypes, dtype_name
from pytest_fp32keep.contract.report import ContractReport, Finding
from tests.contract.tables import table_rows
from tests.core.toys import stack_class

BF16, FP32 = torch.bfloat16, torch.float32


class Tail(nn.Module):
    """Three FP32 operators, then an add with a buffer: FP32 in the reference, bf16 under test
    (promotion makes the add's output FP32 either way)."""

    shift: torch.Tensor

    def __init__(self, buffer_dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("shift", torch.ones(4, dtype=buffer_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul(2).add(1).mul(3).add(self.shift)


class Holder(nn.Module):
    def __init__(self, buffer_dtype: torch.dtype) -> None:
        super().__init__()
        self.tail = Tail(buffer_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tail(x)
        return out


def probed(buffer_dtype: torch.dtype) -> DtypeProbe:
    model = Holder(buffer_dtype)
    with DtypeProbe(model, modules=["tail"], record_grads=False) as probe:
        model(torch.randn(2, 4))
    return probe


def old_rendering(ops: list[OpDtypes]) -> str:
    """What the row printed before: operators with their output dtypes only, cut at 70."""
    text = "; ".join(f"{o.op}->{','.join(dtype_name(d) for d in o.outputs)}" for o in ops)
    return (text or "-")[:70]


def test_a_differing_input_dtype_is_named_in_the_message() -> None:
    reference, observed = probed(FP32), probed(BF16)
    want, got = reference.op_dtypes("tail", 0), observed.op_dtypes("tail", 0)
    # The control: what was compared differs, yet the old rendering printed the same text.
    assert want != got
    assert old_rendering(want) == old_rendering(got)

    findings = check_operators(reference, observed, ["tail"])
    assert [(f.subject, f.expected, f.observed, f.ok) for f in findings] == [
        (
            "tail call 0 op #3 aten.add.Tensor",
            "inputs (float32, float32) -> float32",
            "inputs (float32, bfloat16) -> float32",
            False,
        )
    ]
    report = ContractReport("Holder", BF16, "direct", (), tuple(findings))
    message = str(ContractViolation(report))
    # the row's cells, read back whole (the table wraps them to fit 100 columns); the message
    # may mark where a long pair differs (»like this«): read the pair without marks
    (cells,) = table_rows(message)
    row = {
        column: cell.replace("\u00bb", "").replace("\u00ab", "") for column, cell in cells.items()
    }
    assert row == {
        "check": "operators",
        "subject": "tail call 0 op #3 aten.add.Tensor",
        "expected": "inputs (float32, float32) -> float32",
        "observed": "inputs (float32, bfloat16) -> float32",
    }, message


def test_operators_are_aligned_by_name_and_extra_ones_listed() -> None:
    t = OpDtypes("aten.t.default", (FP32,), (FP32,))
    mm = OpDtypes("aten.mm.default", (FP32, FP32), (FP32,))
    cast = OpDtypes("aten._to_copy.default", (FP32,), (BF16,))
    low = [OpDtypes(o.op, (BF16,) * len(o.inputs), (BF16,)) for o in (t, mm)]
    back = OpDtypes("aten._to_copy.default", (BF16,), (FP32,))
    findings = diff_operators("wo", 0, [t, mm], [cast, cast, *low, back])
    assert [(f.subject, f.expected, f.observed) for f in findings] == [
        (
            "wo call 0 before op #0",
            "absent",
            "aten._to_copy.default(float32) -> bfloat16; "
            "aten._to_copy.default(float32) -> bfloat16",
        ),
        (
            "wo call 0 op #0 aten.t.default",
            "inputs (float32) -> float32",
            "inputs (bfloat16) -> bfloat16",
        ),
        (
            "wo call 0 op #1 aten.mm.default",
            "inputs (float32, float32) -> float32",
            "inputs (bfloat16, bfloat16) -> bfloat16",
        ),
        ("wo call 0 after the last op", "absent", "aten._to_copy.default(bfloat16) -> float32"),
    ]
    assert not any(f.ok for f in findings)


def test_the_table_wraps_long_cells_instead_of_cutting_them() -> None:
    common = "; ".join(f"aten.op{k}.default(float32) -> float32" for k in range(4))
    finding = Finding(
        "operators", "m call 0 ops #0-#4", common + "; float32", common + "; X", False
    )
    assert finding.expected[:70] == finding.observed[:70]  # all the old table showed of them
    lines = ContractReport("M", BF16, "direct", (), (finding,)).table().splitlines()
    start, end = lines[0].index("expected"), lines[0].index("observed")
    column = [line[end:].removesuffix("FAIL").strip() for line in lines[1:]]
    assert " ".join(piece for piece in column if piece) == finding.observed
    column = [line[start:end].strip() for line in lines[1:]]
    assert " ".join(piece for piece in column if piece) == finding.expected
    assert lines[1].endswith("FAIL")


def bf16_kept_matmul(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """fp32keep's sharding (kept ``wo`` stored, all-gathered and handed FP32 activations), then
    every kept ``wo`` made to compute its matmul on bf16 casts of its input and weight."""
    apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)
    patched = 0
    for fqn, wo in model.named_modules():
        if not (fqn.endswith(".wo") and isinstance(wo, nn.Linear)):
            continue

        def forward(x: torch.Tensor, wo: nn.Linear = wo) -> torch.Tensor:
            return F.linear(x.to(BF16), wo.weight.to(BF16)).to(x.dtype)

        setattr(wo, "forward", forward)  # noqa: B010 - an instance attribute, as a patch would
        patched += 1
    assert patched == 2, "the negative control found no kept wo to break"


@pytest.mark.fsdp2
def test_a_kept_matmul_in_bf16_fails_operators(fsdp2_mesh: DeviceMesh) -> None:
    with pytest.raises(ContractViolation) as caught:
        assert_fp32_keep_contract(
            stack_class(strict=["wo", "norm"]),
            lambda model: torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3)),
            mesh=fsdp2_mesh,
            dtype=BF16,
            autocast=False,  # under autocast the reference's kept matmul runs in bf16 too
            shard=bf16_kept_matmul,
        )
    report = caught.value.report
    failed = {check for check, ok in report.status().items() if not ok}
    table = report.table(failures_only=True)
    assert failed == {"operators", "parity"}, table  # the kept matmul's loss shows in parity
    operators = {
        (f.subject, f.expected, f.observed) for f in report.failures if f.check == "operators"
    }
    for layer in (0, 1):
        assert (
            f"layers.{layer}.wo call 0 op #2 aten.mm.default",
            "inputs (float32, float32) -> float32",
            "inputs (bfloat16, bfloat16) -> bfloat16",
        ) in operators, table
    assert all(subject.startswith(("layers.0.wo ", "layers.1.wo ")) for subject, *_ in operators)
    # the message's table (wrapped to fit 100 columns) names the operator whole
    subjects = [row["subject"] for row in table_rows(str(caught.value))]
    assert "layers.0.wo call 0 op #2 aten.mm.default" in subjects, str(caught.value)
