"""docs/families.md's two storage conventions (``pytest_fp32keep.check.families.table``).

A report of ``fp32keep check --master-dtype fp32`` (its ``master_dtype``) is FP32 master weights:
it goes to the page's "FP32 master weights" section with its own runs (torch named), totals,
table and refusals, and never into the table of low-precision storage, even for the same
Transformers label. The reports here are shaped as the command writes them (the top-level
fields of ``tests/cli/test_cli.py``'s real run, the cases' of a real ``--all-families`` run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_fp32keep.check.families import table

LABELS = ["4.56", "5.10", "latest"]
#: A refusal as apply_fsdp2 words it: one problem, its reason tag, the module it cannot split.
KIMI = "model.layers.0.self_attn.forget_gate.dt_bias"
MESSAGE = (
    "FSDP2 cannot keep the FP32 contract of M: 1 problem(s) (mixed-unit); nothing was sharded.\n"
    f"  {KIMI}  [mixed-unit] is kept (torch.float32) but would be all-gathered with unit "
    "'model.layers.0' in the policy's param_dtype: its module "
    "'model.layers.0.self_attn.forget_gate' (KimiLinearForgetGate) also directly owns "
    "parameters the plan does not keep: A_log (torch.float32); FSDP2 puts a module's own "
    "parameters in one unit. Fix: declare it."
)


def _case(family: str, dtype: str, outcome: str, **extra: Any) -> dict[str, Any]:
    case = {"target": f"family/{family}", "dtype": dtype, "context": "autocast"}
    case.update(outcome=outcome, kept=[], failures=[], message="", expect_layout_error=False)
    case.update(extra)
    return case


def _report(torch: str, master_dtype: str | None, cases: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "cases": cases,
        "master_dtype": master_dtype,
        "versions": {"torch": torch, "transformers": "5.25.0", "pytest-fp32keep": "0.1.0"},
        "commit": "abc1234",
        "date": "2026-12-06 10:00 UTC",
        "seconds": 20.4,
        "unavailable": {},
    }


def _storage() -> dict[str, Any]:
    """Low-precision storage on torch 2.13: Kimi-Linear refused as written, T5 passing."""
    written = {"written_in": "pytest_fp32keep/check/families/refusals.py", "why": "dt_bias"}
    return _report(
        "2.13.0+cpu",
        None,
        [
            _case("kimi_linear", dtype, "refused", message=MESSAGE, refused=[KIMI])
            | {"expect_layout_error": True, "written": written}
            for dtype in table.DTYPES
        ]
        + [_case("t5", dtype, "pass", kept=[{}] * 4) for dtype in table.DTYPES],
    )


def _masters(kimi: dict[str, Any]) -> dict[str, Any]:
    """FP32 master weights on torch 2.15: Kimi-Linear's bf16 case as given, its fp16 passing."""
    return _report(
        "2.15.0",
        table.MASTERS,
        [
            _case("kimi_linear", "bf16", **kimi),
            _case("kimi_linear", "fp16", "pass", kept=[{}] * 3),
        ],
    )


def _section(text: str) -> tuple[str, str]:
    """The page before the masters section, and the section."""
    before, found, after = text.partition("\n## FP32 master weights\n")
    assert found, "no FP32 master weights section"
    return before, after


def test_a_masters_report_is_its_own_section_and_leaves_the_storage_table_alone() -> None:
    passing = {"outcome": "pass", "kept": [{}] * 3}
    text = table.render([_storage(), _masters(passing)], LABELS, master_labels=["latest"])
    storage, masters = _section(text)
    # the storage table keeps its refusals: the masters report overwrote nothing
    assert "- latest: transformers 5.25.0, torch 2.13.0+cpu," in storage
    assert "torch 2.15.0" not in storage
    refused = f"refused (mixed-unit: {KIMI}; as written in"
    assert f"| kimi_linear |{' not yet run |' * 4} {refused}" in storage
    assert "| latest | bf16 | 1 | 1 | 0 | 0 | 0 |" in storage
    # the masters section: its run names torch 2.15, its own columns and totals
    assert "- latest: transformers 5.25.0, torch 2.15.0, 2026-12-06 10:00 UTC" in masters
    assert "| family | latest bf16 | latest fp16 |" in masters
    assert "| kimi_linear | pass (3 kept) | pass (3 kept) |" in masters
    assert "| latest | bf16 | 1 | 0 | 0 | 0 | 0 |" in masters
    assert "t5" not in masters  # only the families of the masters report
    assert "### Refusals" not in masters


def test_a_refusal_under_fp32_masters_is_refused_not_pass() -> None:
    """The negative control: the override path refusing Kimi-Linear's bf16 case (no refusal is
    written for FP32 masters on torch 2.15) shows as refused and counts so, not as a pass."""
    refusing = {"outcome": "refused", "message": MESSAGE, "refused": [KIMI], "ok": False}
    _, masters = _section(table.render([_masters(refusing)], LABELS, master_labels=["latest"]))
    cell = f"refused (mixed-unit: {KIMI}; no refusal written)"
    assert f"| kimi_linear | {cell} | pass (3 kept) |" in masters
    assert "| latest | bf16 | 0 | 1 | 0 | 0 | 0 |" in masters
    assert "| latest | fp16 | 1 | 0 | 0 | 0 | 0 |" in masters
    assert "### Refusals" in masters
    assert f"- kimi_linear (latest bf16): `{KIMI} [mixed-unit] is kept" in masters
    assert "  No refusal is written: the check fails." in masters
    failing = {"outcome": "fail", "failures": [{"check": "materialized"}]}
    _, masters = _section(table.render([_masters(failing)], LABELS, master_labels=["latest"]))
    assert "| kimi_linear | FAIL (materialized) | pass (3 kept) |" in masters


def test_a_masters_label_without_its_report_is_not_yet_run() -> None:
    text = table.render([_storage()], LABELS, master_labels=["latest"])
    _, masters = _section(text)
    assert "- latest: not yet run" in masters
    assert "| latest | bf16 | not yet run |" in masters
    assert "## FP32 master weights" not in table.render([_storage()], LABELS)  # not asked for


def test_a_masters_report_without_master_versions_is_an_error_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not silently dropped, and never a storage column: the page is not written."""
    report, page = tmp_path / "latest-fp32-masters.json", tmp_path / "families.md"
    report.write_text(json.dumps(_masters({"outcome": "pass"})))
    with pytest.raises(SystemExit) as exit_:
        table.main(["--output", str(page), "--versions", "latest", str(report)])
    assert exit_.value.code == 2
    assert "given without --master-versions" in capsys.readouterr().err
    assert not page.exists()


def test_the_command_sorts_report_files_by_convention(tmp_path: Path) -> None:
    """``python -m ...table`` as ``nox -s families`` calls it: both reports of one label."""
    storage, masters = tmp_path / "latest.json", tmp_path / "latest-fp32-masters.json"
    storage.write_text(json.dumps(_storage()))
    masters.write_text(json.dumps(_masters({"outcome": "pass", "kept": [{}] * 3})))
    page = tmp_path / "families.md"
    argv = ["--output", str(page), "--versions", ",".join(LABELS), "--master-versions", "latest"]
    assert table.main([*argv, str(masters), str(storage)]) == 0
    before, section = _section(page.read_text())
    assert "torch 2.13.0+cpu" in before and "torch 2.15.0" in section
    assert "| kimi_linear | pass (3 kept) | pass (3 kept) |" in section
