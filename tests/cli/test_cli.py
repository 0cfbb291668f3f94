"""``fp32keep check``: usage errors in the parent, real two-rank runs, reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_fp32keep.cli import main
from tests.error_bounds import PARENT_BOUND_S, within

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--nproc", "0"], "--nproc must be at least 1, got 0", id="nproc-0"),
        pytest.param(["--nproc", "-1"], "--nproc must be at least 1, got -1", id="nproc--1"),
        pytest.param(
            ["--nproc", "abc"], "--nproc must be a whole number, got 'abc'", id="nproc-abc"
        ),
        pytest.param(
            ["--dtype", "fp8"],
            "--dtype takes a comma-separated list of bf16, fp16; got 'fp8'",
            id="dtype-fp8",
        ),
        pytest.param(
            ["--context", "eager"],
            "--context takes a comma-separated list of autocast, direct",
            id="context-eager",
        ),
        pytest.param(["--timeout", "0"], "--timeout must be at least 1", id="timeout-0"),
    ],
)
def test_bad_options_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with within(PARENT_BOUND_S), pytest.raises(SystemExit) as exit_info:
        main(["check", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        pytest.param(
            "no_such_package.models:build",
            "cannot import module 'no_such_package.models'",
            id="missing-module",
        ),
        pytest.param(
            "tests.cli.targets:missing",
            "module 'tests.cli.targets' has no attribute 'missing'",
            id="missing-factory",
        ),
        pytest.param(
            "tests.cli.targets:raises",
            "the factory raised RuntimeError: no weights here",
            id="factory-raises",
        ),
        pytest.param(
            "tests.cli.targets:not_a_module",
            "the factory returned a dict, not a torch.nn.Module",
            id="not-a-module",
        ),
        pytest.param(
            "tests.cli.targets:NOT_CALLABLE", "is a int, not a callable factory", id="not-callable"
        ),
        pytest.param(
            "tests.cli.targets:kept_stack", "has no config.vocab_size; pass --batch", id="no-batch"
        ),
        pytest.param(
            "no_such_zoo_entry", "unknown zoo entries ['no_such_zoo_entry']", id="unknown-zoo-entry"
        ),
        pytest.param(":build", "is not of the form package.module:function", id="malformed"),
    ],
)
def test_bad_targets_fail_before_any_rank_starts(
    target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with within(PARENT_BOUND_S):
        assert main(["check", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp32keep check: error: ")
    assert message in err
    assert target in err or "zoo" in message


def test_list_names_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    assert "t5" in out
    assert "rwkv  (expects KeepLayoutError where its plan keeps anything)" in out


def run_cli(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_fp32keep.cli", "check", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_user_targets_in_two_ranks_with_report(tmp_path: Path) -> None:
    report = tmp_path / "summary.md"
    completed = run_cli(
        "tests.cli.targets:kept_stack",
        "tests.cli.targets:root_owned",
        "--batch",
        "tests.cli.targets:toy_batch",
        "--dtype",
        "bf16",
        "--report",
        str(report),
    )
    # the root-owned layout is refused, and a user's model is not expected to be: exit 1
    assert completed.returncode == 1, completed.stderr[-4000:]
    assert "1 passed, 1 failed" in completed.stdout
    markdown = report.read_text()
    assert "| tests.cli.targets:kept_stack | bf16 | autocast | pass |" in markdown
    assert "FAIL (refused)" in markdown
    assert "[root-owned]" in markdown
    data = json.loads(report.with_suffix(".json").read_text())
    kept = data["cases"][0]["kept"]
    assert {row["fqn"] for row in kept} == {"layers.0.wo.weight", "layers.1.wo.weight"}
    assert {row["stored"] for row in kept} == {"float32"}
    assert data["nproc"] == 2
