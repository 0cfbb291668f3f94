"""Failure messages people can act on (issue 14).

Pure parts first, on real objects, no processes: the ``ContractViolation`` message (one table,
the differing part of long pairs marked, one "what to do" line per failing kind), and the merge
of rank tracebacks (the contract's own frames hidden, identical tracebacks merged after
normalising addresses, paths and ports). Rank reports go through pytest's own serialisation, as
they do on the wire. Then one real failure at 3 ranks: a known-wrong implementation from
``tests/contract/test_negative_controls.py``, whose report must hold one copy of the traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from _pytest._code.code import ExceptionChainRepr
from _pytest.reports import _report_to_json

from pytest_fp32keep.contract import ContractReport, ContractViolation
from pytest_fp32keep.contract.advice import WHAT_TO_DO, differing_part
from pytest_fp32keep.contract.master import validate_master_dtype
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.runner import reports
from pytest_fp32keep.runner.tracebacks import hide_library_frames, merge_key
from tests.contract.tables import table_rows
from tests.inner_outcomes import InnerSession, run_inner_session
from tests.plugin._inner import failure_section
from tests.plugin.test_units import INFO  # the same test item the runner's unit tests report

# --- the violation's message ---------------------------------------------------------------


def _violation(*findings: Finding) -> str:
    report = ContractReport("Decoder", torch.bfloat16, "autocast", (), findings)
    return str(ContractViolation(report))


def test_long_pairs_show_where_they_differ_and_short_ones_are_left_alone() -> None:
    want = "aten._to_copy.default(float32) -> bfloat16; aten.mm.default(bfloat16, bfloat16) -> "
    expected, observed = differing_part(
        want + "bfloat16; aten.add.Tensor(float32) -> float32",
        want + "bfloat16; aten.add.Tensor(bfloat16) -> bfloat16",
    )
    # the common prefix elided, the operator the difference is in kept, the element marked
    assert expected == "…aten.add.Tensor(»float32«) -> float32"
    assert observed == "…aten.add.Tensor(»bfloat16«) -> bfloat16"
    assert differing_part("inputs (float32, float32) -> float32", "inputs (bfloat16, x) -> y") == (
        "inputs (»float32«, float32) -> float32",
        "inputs (»bfloat16«, x) -> y",
    )
    # negative controls: short, equal, or different from the first element: unchanged
    assert differing_part("float32", "bfloat16") == ("float32", "bfloat16")
    same = "inputs (float32, float32) -> float32"
    assert differing_part(same, same) == (same, same)
    assert differing_part("absent", "aten._to_copy.default(float32) -> bfloat16") == (
        "absent",
        "aten._to_copy.default(float32) -> bfloat16",
    )


def test_violation_is_one_table_then_what_to_do_per_failing_kind() -> None:
    long_want = "inputs (float32, float32) -> float32"
    long_got = "inputs (bfloat16, bfloat16) -> bfloat16"
    # the gathered tensor is another module's: its failure does not explain the operators row
    text = _violation(
        Finding("materialized", "layers.1.wo.weight (call 0)", "float32", "bfloat16", False),
        Finding(
            "operators", "layers.0.wo call 0 op #1 aten.mm.default", long_want, long_got, False
        ),
        Finding("parity", "loss", "0.5", "0.5", True),
        Finding("crashed", "backward", "no exception", "RuntimeError: boom", False),
    )
    lines = text.splitlines()
    # the headline the negative controls parse, wrapped to fit 100 columns as pytest prints it
    # (after "E", the raise's indentation and "pytest_fp32keep.ContractViolation: ")
    assert " ".join(line.strip() for line in lines[:2]) == (
        "FP32-keep contract broken for Decoder at bfloat16 (autocast): "
        "materialized, operators, crashed"
    )
    assert lines[1].startswith("  ")  # a continuation
    assert re.match(r"check\s+subject\s+expected\s+observed$", lines[2])
    assert re.search(
        r"materialized\s+layers\.1\.wo\.weight \(call 0\)\s+float32\s+bfloat16\s+FAIL", text
    )
    assert "follow from" not in text
    # the long pair marked where it differs, wrapped within its columns to fit the width
    assert not any("inputs (»float32«, float32) -> float32" in line for line in lines)  # wrapped
    operators = next(row for row in table_rows(text) if row["check"] == "operators")
    assert operators == {
        "check": "operators",
        "subject": "layers.0.wo call 0 op #1 aten.mm.default",
        "expected": "inputs (»float32«, float32) -> float32",
        "observed": "inputs (»bfloat16«, bfloat16) -> bfloat16",
    }, text
    assert "parity" not in text.split("what to do:")[0].split("\n", 1)[1]  # passing rows not shown
    advice = text.split("what to do:\n", 1)[1].splitlines()
    firsts = [line for line in advice if not line.startswith("    ")]
    assert [line.split(":")[0].strip() for line in firsts] == [
        "materialized",
        "operators",
        "crashed",
    ]
    assert "param_dtype=None (fp32keep.apply_fsdp2 does)" in " ".join(" ".join(advice).split())
    assert max(len(line) for line in lines) <= 88  # 100 columns behind pytest's "E" and indent
    assert text.count("what to do:") == 1


#: One kept unit gathered in bf16, as the wrong fix "kept units with the caller's policy" does:
#: the gather fails, then the operators it feeds, then logits, loss and the gradients.
GATHERED_LOW = (
    Finding("parity", "logits", "bfloat16 bit-identical", "max |diff| 0.0312", False),
    Finding("parity", "loss", "float32 bit-identical", "max |diff| 0.00024", False),
    *(
        Finding("parity", f"grad layers.{i}.wo.weight", "bit-identical (control)", "3e-03", False)
        for i in range(10)
    ),
    Finding(
        "operators",
        "layers.0.wo call 0 op #1 aten.mm.default",
        "aten._to_copy.default(float32) -> bfloat16; aten.mm.default(bfloat16, bfloat16) -> "
        "bfloat16; aten.add.Tensor(float32) -> float32",
        "aten._to_copy.default(float32) -> bfloat16; aten.mm.default(bfloat16, bfloat16) -> "
        "bfloat16; aten.add.Tensor(bfloat16) -> bfloat16",
        False,
    ),
    Finding("materialized", "layers.0.wo.weight (call 0)", "float32", "bfloat16", False),
)


def test_the_cause_leads_and_the_parity_rows_it_explains_fold_into_one_line() -> None:
    report = ContractReport("Decoder", torch.bfloat16, "autocast", (), GATHERED_LOW)
    text = str(ContractViolation(report))
    rows = text.split("what to do:")[0].splitlines()[3:]  # after the headline's 2 lines, header
    # found last, listed first: the contract's order puts the cause before what follows from it
    assert rows[0].startswith("materialized  layers.0.wo.weight (call 0)"), text
    # the operators row of the module whose weight was gathered low folds too (issue 36)
    assert [row.split()[0] for row in rows if row.endswith("FAIL")] == ["materialized"]
    assert (
        "1 operators row follows from the materialized failure above (1 kept module: "
        "layers.0.wo)" in " ".join(text.split())
    ), text
    assert (
        "12 parity rows follow from the materialized failure above (logits, loss, 12 gradients)"
        not in text
    )
    assert "12 parity rows follow from the materialized failure above (logits, loss, 10" in text
    assert not re.search(r"^parity\s", text, flags=re.M)  # no parity row of its own
    assert len(report.failures) == 14 and '"check": "parity"' in report.to_json()  # all kept
    assert max(len(line) for line in text.splitlines()) <= 88
    # negative control: with nothing earlier failing, parity rows are the cause and show whole
    alone = ContractReport("Decoder", torch.bfloat16, "autocast", (), GATHERED_LOW[:12])
    shown = str(ContractViolation(alone))
    assert "follow from" not in shown
    assert len(re.findall(r"^parity\s", shown, flags=re.M)) == 12


def test_every_check_kind_has_a_what_to_do_line() -> None:
    from pytest_fp32keep.contract import CHECKS

    assert set(CHECKS) | {"crashed"} <= set(WHAT_TO_DO)
    kinds = set(WHAT_TO_DO)
    for kind, line in WHAT_TO_DO.items():
        # no line names another kind: `pytest.raises(ContractViolation, match=KIND)` still
        # tells which kinds failed
        assert [other for other in kinds - {kind} if other in line] == [], (kind, line)


# --- rank tracebacks -----------------------------------------------------------------------


def _raised(call: Callable[[], Any], showlocals: bool = False) -> ExceptionChainRepr:
    """pytest's long repr of what ``call`` raises, as pytest makes it in a rank."""
    try:
        call()
    except Exception:
        info = pytest.ExceptionInfo.from_current()
    else:  # pragma: no cover - the calls below all raise
        raise AssertionError("expected an exception")
    made = info.getrepr(style="long", funcargs=True, chain=True, showlocals=showlocals)
    assert isinstance(made, ExceptionChainRepr)
    return made


def _over_the_wire(longrepr: Any, stop: float) -> pytest.TestReport:
    """A failed call report of one rank, serialised and rebuilt as the controller sees it."""
    made = pytest.TestReport(
        INFO.nodeid, INFO.location, INFO.keywords, "failed", longrepr, "call", stop=stop, start=0.5
    )
    return pytest.TestReport._from_json(_report_to_json(made))


def _merged_text(longreprs: list[Any]) -> str:
    outcomes = []
    for rank, longrepr in enumerate(longreprs):
        passed = [
            pytest.TestReport(INFO.nodeid, INFO.location, INFO.keywords, "passed", None, when)
            for when in ("setup", "teardown")
        ]
        call = _over_the_wire(longrepr, stop=1.0 + rank)
        outcomes.append(reports.RankOutcome(rank, [passed[0], call, passed[1]], finished=True))
    call_report = reports.merge(INFO, outcomes)[1]
    assert call_report.failed
    return call_report.longreprtext


def users_check(validated: object, marker: object) -> None:
    """Stands for a user's helper that calls into the contract (``marker``'s address differs
    per call, as objects' addresses differ per rank)."""
    validate_master_dtype(validated)


def test_contract_frames_are_hidden_and_identical_tracebacks_merged() -> None:
    # three ranks, the same failure; addresses differ (each rank's objects are its own)
    markers = [object() for _ in range(3)]
    raised = [_raised(lambda m=m: users_check(torch.bfloat16, m)) for m in markers]  # type: ignore[misc]
    raw = [str(r) for r in raised]
    assert raw[0] != raw[1], "addresses should differ between the ranks' tracebacks"
    assert "pytest_fp32keep/contract/master.py" in raw[0]  # the frame the filter must hide
    text = _merged_text(raised)
    assert "ranks 0,1,2 (root cause: first to fail)" in text
    assert text.count("ValueError: assert_fp32_keep_contract(master_dtype=torch.bfloat16)") == 1
    assert "validate_master_dtype(validated)" in text  # the user's own line stays
    assert "contract/master.py" not in text
    assert "1 frame of pytest_fp32keep's contract" in text
    # negative control: without the merge, three copies
    naive = "\n".join(raw)
    assert naive.count("ValueError: assert_fp32_keep_contract(master_dtype=") == 3


def test_tracebacks_that_really_differ_are_not_merged() -> None:
    same = [_raised(lambda: users_check(torch.bfloat16, object())) for _ in range(2)]
    other = _raised(lambda: users_check("fp16", object()))
    text = _merged_text([*same, other])
    assert "ranks 0,1 (root cause: first to fail)" in text
    assert re.search(r"-+ rank 2 -+", text), text
    assert "master_dtype='fp16'" in text


def a_test_of_the_user(fsdp2_rank: int, fsdp2_device: str, fsdp2_world_size: int) -> None:
    """Stands for a test that takes the runner's per-rank fixtures (pytest prints its
    arguments, and under ``-l`` its locals, with each rank's own values)."""
    expected = {"layers.0": "float32"}
    assert expected["layers.0"] == f"bfloat16 on {fsdp2_world_size} ranks"


def a_test_that_fails_per_rank(fsdp2_rank: int, fsdp2_device: str, fsdp2_world_size: int) -> None:
    """Stands for a test whose failure itself differs per rank."""
    assert fsdp2_rank == 5


def _as_rank(rank: int, test: Callable[[int, str, int], None]) -> Callable[[], None]:
    """``test`` as rank ``rank`` calls it (through a frame whose own argument is named like the
    fixture, as the test's is: only the fixtures' values differ between the ranks)."""

    def run(fsdp2_rank: int = rank) -> None:
        test(fsdp2_rank, f"cuda:{fsdp2_rank}", 3)

    return run


@pytest.mark.parametrize("showlocals", [False, True], ids=["args", "args-and-locals"])
def test_identical_failures_merge_although_each_rank_prints_its_own_fsdp2_rank(
    showlocals: bool,
) -> None:
    raised = [_raised(_as_rank(rank, a_test_of_the_user), showlocals) for rank in range(3)]
    raw = [str(r) for r in raised]
    assert "fsdp2_rank = 1, fsdp2_device = 'cuda:1', fsdp2_world_size = 3" in raw[1]
    assert ("fsdp2_device = 'cuda:1'\n" in raw[1]) is showlocals  # a local on its own line
    text = _merged_text(raised)
    assert "ranks 0,1,2 (root cause: first to fail)" in text
    assert text.count("AssertionError: assert 'float32' == 'bfloat16 on 3 ranks'") == 1, text
    # one block for three ranks: no rank's value stands for the others; the rest is kept
    assert "fsdp2_rank = <per rank>, fsdp2_device = <per rank>, fsdp2_world_size = 3" in text
    assert ("fsdp2_device = <per rank>\n" in text) is showlocals
    assert ("expected   = {'layers.0': 'float32'}" in text) is showlocals
    assert not re.search(r"fsdp2_rank\s*= \d", text), text
    # negative control: without the masking, each rank's block differs
    assert len({merge_key(r) for r in raw}) == 3


def test_failures_that_differ_by_more_than_the_rank_keep_their_values() -> None:
    raised = [_raised(_as_rank(rank, a_test_that_fails_per_rank)) for rank in range(2)]
    text = _merged_text(raised)
    assert re.search(r"-+ rank 0 \(root cause: first to fail\) -+", text), text
    assert re.search(r"-+ rank 1 -+", text), text
    assert "E       assert 0 == 5" in text and "E       assert 1 == 5" in text
    assert "fsdp2_rank = 0, fsdp2_device = 'cuda:0'" in text  # each block its own values
    assert "fsdp2_rank = 1, fsdp2_device = 'cuda:1'" in text
    assert "<per rank>" not in text


def test_a_traceback_only_of_library_frames_is_left_whole() -> None:
    raised = _raised(lambda: validate_master_dtype(torch.bfloat16))
    # the test's own frame is the first entry: hide it from the picture by keeping only the
    # library's, as for an error raised inside the plugin itself
    raised.chain[-1][0].reprentries = raised.chain[-1][0].reprentries[-1:]
    assert str(hide_library_frames(raised)) == str(raised)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("<function batch at 0x7feac9252340>", "<function batch at 0x7f82ad00a340>"),
        ("/tmp/pytest-of-u/pytest-3/rank1/log.txt", "/tmp/pytest-of-u/pytest-4/rank0/log.txt"),
        ("/srv/run/rank_1/out.txt:12", "/srv/run/rank_0/out.txt:12"),
        ("connect to 127.0.0.1:29501 refused", "connect to 127.0.0.1:41377 refused"),
        # a set of strings prints in hash order, which differs per process
        ("taken      = {'layers.1', 'layers.0'}", "taken      = {'layers.0', 'layers.1'}"),
    ],
)
def test_merge_key_normalises_what_differs_between_ranks(one: str, other: str) -> None:
    assert merge_key(one) == merge_key(other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("AssertionError: rank 1 is wrong", "AssertionError: rank 0 is wrong"),
        ("test_x.py:12: in check", "test_x.py:13: in check"),
        ("max |diff| 0.00806", "max |diff| 0.00807"),
        ("taken = {'layers.0', 'layers.1'}", "taken = {'layers.0', 'layers.2'}"),
    ],
)
def test_merge_key_keeps_real_differences(one: str, other: str) -> None:
    assert merge_key(one) != merge_key(other)


# --- one real failure at 3 ranks -------------------------------------------------------------

#: The known-wrong implementation run at 3 ranks: kept units with the caller's bf16 policy.
WRONG = "test_kept_units_with_the_callers_bf16_policy"
#: The most lines the failure section of one contract failure may take at 3 ranks: one copy of
#: the traceback (about 15 lines: the test's frame with its argument, the helper's frame), the
#: violation's headline, table header and rows (this failure: 4 materialized, 8 operators, the
#: operators' cells wrapped to fit 100 columns, and its 14 parity rows folded into one line) and
#: the what-to-do block (1 + about 3 wrapped lines per kind: 10), plus titles, separators and
#: blank lines. Two copies of the table plus one traceback would exceed it; before issue 14 the
#: section was 493 lines, 50 after it (214 columns wide), MEASURED after issue 22.
MAX_FAILURE_LINES = 80
#: The widest line of it: the terminal's 100 columns (issue 22; it was 214).
MAX_FAILURE_COLUMNS = 100


def _three_rank_failure(folder: Path) -> InnerSession:
    from tests.contract.test_negative_controls import INNER

    files = {"test_controls.py": INNER}
    target = f"test_controls.py::{WRONG}"
    return run_inner_session(folder, files, "--fsdp-nproc", "3", target, timeout=600)


def _layout_refusal(folder: Path) -> InnerSession:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    files = {"test_refusal.py": LAYOUT_REFUSAL}
    return run_inner_session(folder, files, "--tb=long", "-l", timeout=600, env=env)


@pytest.fixture(scope="module")
def real_failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, InnerSession]:
    """Both inner sessions with real failures, started together (each mostly starts ranks)."""
    runs = {"three ranks": _three_rank_failure, "layout refusal": _layout_refusal}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {
            name: pool.submit(run, tmp_path_factory.mktemp("inner")) for name, run in runs.items()
        }
        return {name: future.result() for name, future in futures.items()}


def test_one_contract_failure_at_three_ranks_is_one_traceback(
    real_failures: dict[str, InnerSession],
) -> None:
    session = real_failures["three ranks"]
    assert session.returncode == 1, session.output[-6000:]
    text = failure_section(session.output, WRONG)
    lines = text.splitlines()
    assert "fsdp2: call failed on ranks 0,1,2 of 3" in text
    assert re.search(r"-+ ranks 0,1,2 \(root cause: first to fail\) -+", text), text
    assert text.count("FP32-keep contract broken for Decoder") == 1, text
    assert "pytest_fp32keep/contract/" not in text, text  # the contract's own frames hidden
    assert "check(fsdp2_mesh, shard=shard_kept_with(lambda p: p))" in text  # the user's line
    assert "what to do:" in text and "materialized: kept parameters were all-gathered" in text
    # the headline the negative controls parse (its end), and their table row, as before
    assert "): materialized, operators, parity\n" in text
    assert re.search(
        r"materialized\s+layers\.0\.wo\.weight \(call 0\)\s+float32\s+bfloat16\s+FAIL", text
    )
    # the cause leads the table; the parity rows it explains are one line
    header = next(i for i, line in enumerate(lines) if re.match(r"E\s+check\s+subject", line))
    assert re.match(r"E\s+materialized\s", lines[header + 1]), text
    assert re.search(r"E\s+\d+ parity rows follow from the materialized failure above", text)
    assert not re.search(r"^E\s+parity\s+(logits|loss|grad)", text, flags=re.M), text
    ours = [line for line in lines if not line.startswith("- generated xml file:")]  # junitxml's
    widest = max(len(line) for line in ours)
    assert widest <= MAX_FAILURE_COLUMNS, f"{widest} columns:\n{text}"
    assert len(lines) <= MAX_FAILURE_LINES, f"{len(lines)} lines:\n{text}"


# --- one layout refusal at 2 ranks, read as users read it (--tb=long, --showlocals) ---------

#: A model ``apply_fsdp2`` refuses (a kept parameter owned by the root module, BLIP-2's
#: ``query_tokens``, beside one the plan does not keep), with the plan in the test's locals, as a
#: user's test has it.
LAYOUT_REFUSAL = """
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.attn(x))


class Toy(nn.Module):
    _keep_in_fp32_modules_strict = ["query_tokens", "norm"]
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.randn(2, 8))
        self.scale = nn.Parameter(torch.ones(8))
        self.layers = nn.ModuleList(Block() for _ in range(3))


@pytest.mark.fsdp2
def test_root_owned_kept_parameter_is_refused(fsdp2_mesh):
    model = Toy()
    plan = fp32keep.resolve_keep_plan(model, torch.bfloat16)
    fp32keep.keep_aware_cast(model, torch.bfloat16, plan=plan)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fp32keep.apply_fsdp2(model, mesh=fsdp2_mesh, mp_policy=policy, plan=plan)
"""
#: The most lines its failure section may take: one copy of the test's frame with its locals
#: and the refusal's message, wrapped (about 45 lines). Before issue 22 each rank printed its
#: own copy (540 lines): the plan's repr listed its kept names in set order, which differs
#: between processes (string hashes are salted per process), so the ranks' tracebacks never
#: read the same; before issue 36 the copy held apply_fsdp2's and plan_layout's docstrings and
#: source (about 265 lines), and the problem lines were up to 275 columns wide.
MAX_REFUSAL_LINES = 80


def test_a_layout_refusal_at_two_ranks_is_one_traceback_even_with_locals(
    real_failures: dict[str, InnerSession],
) -> None:
    session = real_failures["layout refusal"]
    assert session.returncode == 1, session.output[-6000:]
    text = failure_section(session.output, "test_root_owned_kept_parameter_is_refused")
    assert "fsdp2: call failed on ranks 0,1 of 2" in text
    assert re.search(r"-+ ranks 0,1 \(root cause: first to fail\) -+", text), text
    assert "plan       = KeepPlan(" in text  # the locals are shown, the plan among them
    # the library's own error: its frames hidden (fp32keep's __tracebackhide__), the message
    # under the test's line, its problem lines wrapped to 100 columns (issue 36)
    assert "def plan_layout(" not in text and "def apply_fsdp2(" not in text, text
    assert "fp32keep/layout/planning.py" not in text and "fp32keep/shard/apply.py" not in text, text
    assert "fp32keep.apply_fsdp2(model, mesh=fsdp2_mesh, mp_policy=policy, plan=plan)" in text
    assert text.count("E       fp32keep.errors.KeepLayoutError: FSDP2 cannot keep") == 1, text
    assert "E         query_tokens  [root-owned] is kept (torch.float32)" in text
    error_lines = [line for line in text.splitlines() if line.startswith("E")]
    assert len(error_lines) > 6 and max(len(line) for line in error_lines) <= 100, text
    lines = text.splitlines()
    assert len(lines) <= MAX_REFUSAL_LINES, f"{len(lines)} lines:\n{text}"
