"""``fp32keep check``: usage errors in the parent, real two-rank runs, reports."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from pytest_fp32keep.check.cli import main
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


#: The installed console script, as a user runs it (not ``python -m``).
CONSOLE_SCRIPT = Path(sys.executable).with_name("fp32keep")


def run_cli(
    *argv: str, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the console script; its output goes through files, not pipes, so that a rank left
    behind holding them cannot keep this call waiting."""
    assert CONSOLE_SCRIPT.exists(), f"the console script is not installed at {CONSOLE_SCRIPT}"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        completed = subprocess.run(
            [str(CONSOLE_SCRIPT), "check", *argv],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=err,
            text=True,
            timeout=900,
            check=False,
        )
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            completed.args, completed.returncode, out.read(), err.read()
        )


#: A user's own module, in a folder outside the repository: a tiny real Transformers T5
#: (keeps ``wo`` under fp16) whose batch comes from ``config.vocab_size``.
USER_MODULE = """
from transformers import T5Config, T5ForConditionalGeneration


def build():
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, dropout_rate=0.0)
    return T5ForConditionalGeneration(config)
"""


def test_console_script_imports_a_users_module_from_the_current_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "mymodels.py").write_text(USER_MODULE)
    completed = run_cli("mymodels:build", "--dtype", "fp16", cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "1 passed, 0 failed" in completed.stdout
    assert "4: stored float32" in completed.stdout  # the four `wo` weights are kept


#: Set for the console script in a test and inherited by all it starts: finds its leftovers.
MARK_VARIABLE = "FP32KEEP_TEST_MARK"


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK_VARIABLE=mark`` (inherited)."""
    marker = f"{MARK_VARIABLE}={mark}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes() + b"\0"
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def killed_leftovers(mark: str) -> list[int]:
    """The processes still marked with ``mark``, killed so that a failure poisons no later test."""
    leftovers = processes_marked(mark)
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return leftovers


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
def test_timeout_leaves_no_rank_alive(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK_VARIABLE: mark}
    # The ranks sleep in the factory long after the timeout: only a kill ends them.
    completed = run_cli(
        "tests.cli.targets:slow_in_ranks",
        "--batch",
        "tests.cli.targets:toy_batch",
        "--timeout",
        "15",
        env=env,
    )
    assert completed.returncode == 1
    assert "did not finish within --timeout 15 s and were killed" in completed.stderr
    assert killed_leftovers(mark) == [], "a rank of the timed-out check was still running"


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
