"""``fp32keep check`` on a case that keeps nothing: ``pass (nothing kept)`` with a note saying why,
and ``--expect-kept N`` failing it (real runs of the console script, and the renderer alone)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pytest_fp32keep.check.render import render_markdown, render_text
from tests.cli.test_cli import ROOT, _case, _environment, _result, run_cli
from tests.contract.test_nothing_kept import NO_GATE

NOTE = "nothing is kept in FP32 at bfloat16: KeptStack declares _keep_in_fp32_modules ['wo']"


def _nothing_kept(context: str) -> dict[str, Any]:
    case = _case("t5", context=context, dtype="bf16")
    case["notes"] = [f"{NOTE}, which Transformers 5.10.4 applies only under float16; ..."]
    return case


def test_a_case_that_keeps_nothing_reads_pass_nothing_kept_with_its_note_once() -> None:
    result = _result([_nothing_kept("autocast"), _nothing_kept("direct"), _case("t5", kept=4)])
    text = " ".join(render_text(result, 100).split())
    assert text.count("pass (nothing kept)") == 3  # two rows and the legend
    assert "pass (nothing kept) = the contract held with no tensor kept in FP32" in text
    assert text.count(f"note: t5 bf16: {NOTE}") == 1  # one note for both contexts
    markdown = render_markdown(result)
    assert "| t5 | bf16 | autocast | pass (nothing kept) |" in markdown
    assert "| t5 | fp16 | autocast | pass |" in markdown  # negative control: it keeps 4


def _run(user_folder: Path, *extra: str) -> tuple[Any, dict[str, Any]]:
    report = user_folder / f"report{len(extra)}.json"
    completed = run_cli(
        "tests.cli.targets:regular_stack",
        *("--batch", "tests.cli.targets:toy_batch", "--dtype", "bf16,fp16"),
        *("--report-json", str(report), *extra),
        cwd=user_folder,
        env=_environment(PYTHONPATH=str(ROOT)),
    )
    return completed, json.loads(report.read_text()) if report.exists() else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same toy at bf16 and fp16, without and with ``--expect-kept 1``, started together."""
    folder = tmp_path_factory.mktemp("user-project")
    with ThreadPoolExecutor(max_workers=2) as pool:
        plain = pool.submit(_run, folder)
        expecting = pool.submit(_run, folder, "--expect-kept", "1")
        return {"plain": plain.result(), "expecting": expecting.result()}


def test_the_vacuous_bf16_case_passes_as_nothing_kept_and_says_why(runs: dict[str, Any]) -> None:
    completed, data = runs["plain"]
    out = " ".join(completed.stdout.split())
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "2 passed, 0 failed" in out
    kept = {case["dtype"]: len(case["kept"]) for case in data["cases"]}
    if NO_GATE:  # 5.0.0 keeps the regular list at bf16 too: nothing vacuous to say
        assert kept == {"bf16": 2, "fp16": 2} and "nothing kept" not in out
        return
    assert kept == {"bf16": 0, "fp16": 2}
    assert "pass (nothing kept)" in out
    assert f"note: tests.cli.targets:regular_stack bf16: {NOTE}, which Transformers " in out
    assert "applies only under float16" in out


def test_expect_kept_fails_the_case_that_keeps_fewer(runs: dict[str, Any]) -> None:
    completed, data = runs["expecting"]
    out = " ".join(completed.stdout.split())
    outcomes = {case["dtype"]: case["ok"] for case in data["cases"]}
    if NO_GATE:
        assert completed.returncode == 0 and outcomes == {"bf16": True, "fp16": True}
        return
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert outcomes == {"bf16": False, "fp16": True}  # fp16 keeps 2 >= 1
    assert "1 passed, 1 failed" in out
    assert "tests.cli.targets:regular_stack bf16 autocast: FAIL" in out
    assert "`kept count` tensors kept in FP32 at bfloat16: expected at least 1" in out
    assert "observed 0 (nothing kept: see the note)" in out
