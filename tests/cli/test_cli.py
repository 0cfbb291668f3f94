"""``fp32keep check``: usage errors in the parent, real two-rank runs, reports."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from pytest_fp32keep.check.cli import _write_reports, main
from pytest_fp32keep.check.layout import Column, column_widths, wrap_cell, wrap_text
from pytest_fp32keep.check.render import progress_line, render_markdown, render_text
from pytest_fp32keep.check.zoo import transformers_version
from tests.cli.targets import NOISY_LINE, NOISY_WARNING
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
        pytest.param(
            ["--expect-kept", "0"], "--expect-kept must be at least 1, got 0", id="expect-kept-0"
        ),
        pytest.param(
            ["--expect-kept", "all"],
            "--expect-kept must be a whole number, got 'all'",
            id="expect-kept-all",
        ),
    ],
)
def test_bad_options_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with within(PARENT_BOUND_S), pytest.raises(SystemExit) as exit_info:
        main(["check", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``fp32keep check ARGV`` in-process: a usage error (exit 2, no rank); its stderr."""
    with within(PARENT_BOUND_S), pytest.raises(SystemExit) as exit_info:
        main(["check", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fp32keep check: error:" in err
    return err


def test_report_into_a_missing_folder_is_a_usage_error_before_any_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "folder"
    err = _usage_error(["--report", str(missing / "summary.md")], capsys)
    assert f"argument --report: the folder '{missing}' does not exist" in err
    assert f"mkdir -p {missing}" in err
    err = _usage_error(["--report-json", str(missing / "summary.json")], capsys)
    assert f"argument --report-json: the folder '{missing}' does not exist" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
def test_report_into_a_folder_nobody_can_write_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # /proc takes no new files even from root, for whom os.access always says yes
    err = _usage_error(["--report", "/proc/summary.md"], capsys)
    assert "argument --report: cannot write in the folder '/proc'" in err
    assert "choose a folder you can write to" in err


def test_report_naming_a_folder_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(["--report", str(tmp_path)], capsys)
    assert f"argument --report: '{tmp_path}' is a folder; name a file in it" in err
    assert str(tmp_path / "summary.md") in err


def test_json_name_for_the_markdown_report_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "r.json")
    err = _usage_error(["--report", path], capsys)
    assert f"argument --report: '{path}' ends in .json, but --report writes Markdown" in err
    assert f"use --report-json '{path}'" in err
    path = str(tmp_path / "r.md")
    err = _usage_error(["--report-json", path], capsys)
    assert f"argument --report-json: '{path}' ends in .md, but --report-json writes JSON" in err
    assert f"use --report '{path}'" in err
    same = str(tmp_path / "report")
    err = _usage_error(["--report", same, "--report-json", same], capsys)
    assert "--report and --report-json name the same file" in err


@pytest.mark.parametrize(
    "targets", [pytest.param([], id="whole-zoo"), pytest.param(["t5", "llama"], id="zoo-names")]
)
def test_batch_with_only_zoo_targets_is_a_usage_error(
    targets: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error([*targets, "--batch", "tests.cli.targets:toy_batch"], capsys)
    assert "--batch applies to package.module:factory TARGETs only" in err
    assert "drop --batch, or name your module:factory TARGET" in err
    assert ("t5, llama" if targets else "the whole zoo") in err


def test_report_options_choose_the_files(tmp_path: Path) -> None:
    """--report writes Markdown and JSON beside it; --report-json moves or alone writes JSON."""
    result = _result([_case("t5", kept=4)])

    def write(report: Path | None, report_json: Path | None) -> None:
        args = argparse.Namespace(report=report, report_json=report_json)
        assert _write_reports(args, result) is None

    write(tmp_path / "a.md", None)
    assert (tmp_path / "a.md").read_text().startswith("## FP32-keep contract")
    assert json.loads((tmp_path / "a.json").read_text())["nproc"] == 2
    args = argparse.Namespace(report=None, report_json=tmp_path / "data" / "c.json")
    assert "cannot write the report" in str(_write_reports(args, result))
    (tmp_path / "data").mkdir()
    write(None, tmp_path / "data" / "c.json")
    assert json.loads((tmp_path / "data" / "c.json").read_text())["cases"][0]["target"] == "t5"
    write(tmp_path / "d.md", tmp_path / "data" / "d.json")
    assert (tmp_path / "d.md").exists()
    assert not (tmp_path / "d.json").exists()
    assert (tmp_path / "data" / "d.json").exists()


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
    # the zoo's written expectation: Rwkv's regular list applies at fp16 in every release, at
    # bf16 too in 5.0.0 alone (no dtype gate: docs/transformers-keep-semantics.md)
    no_gate = Version(transformers_version()).release == (5, 0, 0)
    refused = "bf16, fp16" if no_gate else "fp16"
    assert f"rwkv  (expects KeepLayoutError at {refused})\n" in out


def _case(target: str, *, kept: int = 0, outcome: str = "pass", **extra: Any) -> dict[str, Any]:
    """A case as the ranks write it."""
    passed = outcome == "pass"
    case: dict[str, Any] = {
        "target": target,
        "dtype": "fp16",
        "context": "autocast",
        "expect_layout_error": False,
        "status": {} if outcome == "refused" else dict.fromkeys(CHECKS, passed),
        "kept": [
            {
                "fqn": f"layers.{i}.wo.weight",
                "entry": "wo",
                "list_kind": "regular",
                "stored": "float32",
                "materialized": "float32",
            }
            for i in range(kept)
        ],
        "failures": [],
        "message": "",
        "outcome": outcome,
        "ok": passed,
    }
    case.update(extra)
    return case


CHECKS = ("stored", "materialized", "boundary", "operators", "parity", "round trip")


def _result(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """A result as the command assembles it."""
    return {
        "cases": cases,
        "device": "cpu",
        "backend": "gloo",
        "view_warnings": {"count": 18, "modules": ["FSDPT5Block"]},
        "nproc": 2,
        "versions": {"torch": "2.13.0", "transformers": "5.10.4", "pytest-fp32keep": "0.1.0"},
        "commit": "abc1234",
        "threads": "OMP_NUM_THREADS=1 (torchrun's default)",
        "date": "2026-01-01 00:00 UTC",
        "seconds": 12.5,
        "unavailable": {},
    }


def _zoo_like_result() -> dict[str, Any]:
    """Every kind of row: kept, nothing kept, refused as expected, a failure, a long name."""
    refused = [f"rwkv.blocks.{i}.attention.time_decay" for i in range(4)]
    failing = _case("gpt_oss", kept=5, outcome="fail", ok=False)
    failing["status"]["parity"] = False
    failing["failures"] = [
        {
            "check": "parity",
            "subject": "grad model.layers.0.mlp.experts.gate_up_proj",
            "expected": "<= 0.0164 relative",
            "observed": "0.5 relative",
            "ok": False,
        }
    ]
    return _result(
        [
            _case("t5", kept=4),
            _case("llama"),
            _case(
                "instructblip",
                outcome="refused",
                ok=True,
                refused=refused,
                expect_layout_error=True,
            ),
            failing,
            _case("my_company.research.models.experimental:build_the_big_one", kept=2),
        ]
    )


def _check_fits(text: str, width: int) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, max(lines, key=len)
    assert [line for line in lines if line != line.rstrip()] == []


@pytest.mark.parametrize("width", [80, 100, 160])
def test_terminal_report_fits_the_width(width: int) -> None:
    result = _zoo_like_result()
    text = render_text(result, width)
    _check_fits(text, width)
    assert text.startswith("fp32keep check: 2 ranks on gloo (cpu), OMP_NUM_THREADS=1")
    for field in ("torch 2.13.0", "transformers 5.10.4", "commit abc1234", "5 cases in 12.5 s"):
        assert field in " ".join(text.split())
    assert "legend: stored = dtype at rest" in text
    assert "pass (refused) = apply_fsdp2 refused" in " ".join(text.split())
    assert text.count("torch warned 18 times") == 1
    assert "4: stored float32, all-gathered float32" in text  # kept: a column or a line below
    assert "expected <= 0.0164 relative, observed 0.5" in " ".join(text.split())


def test_kept_tensors_are_a_column_only_where_they_fit() -> None:
    result = _result([_case("t5", kept=4), _case("llama")])
    wide = render_text(result, 160).splitlines()
    assert any(line.startswith("model") and line.endswith("kept tensors") for line in wide)
    assert any(line.startswith("t5 ") and line.endswith("all-gathered float32") for line in wide)
    narrow = render_text(result, 100).splitlines()
    row = next(index for index, line in enumerate(narrow) if line.startswith("t5 "))
    assert narrow[row + 1] == "    kept 4: stored float32, all-gathered float32"
    assert not any("kept tensors" in line for line in narrow)
    assert not any(line.lstrip().startswith("kept") for line in narrow[row + 2 :][:2])  # llama


def test_no_commit_outside_a_repository_and_legend_only_what_is_shown() -> None:
    result = _result([_case("t5", kept=4)])
    result["commit"] = None
    text = render_text(result, 100)
    assert "commit" not in text
    assert "refused" not in text  # no refused row: no word about refusals
    assert "never all-gathered" not in text


def test_markdown_report_has_the_header_and_legend() -> None:
    markdown = render_markdown(_zoo_like_result())
    assert "| t5 | fp16 | autocast | pass | pass | pass | pass | pass | pass | pass |" in markdown
    assert "2 ranks on gloo (cpu)" in markdown
    assert "commit abc1234" in markdown
    assert "stored = dtype at rest; materialized = dtype when all-gathered" in markdown
    assert "*Note:* torch warned 18 times" in markdown
    assert "### gpt_oss fp16 (autocast): FAIL" in markdown


def test_layout_wraps_names_at_separators_and_never_widens() -> None:
    assert wrap_cell("tests.cli.targets:kept_stack", 12) == ["tests.cli.", "targets:", "kept_stack"]
    assert wrap_text("a " * 30, 20, first="x: ", rest="  ")[1].startswith("  a")
    columns = [Column("model", ["m" * 29], min_width=12), Column("result", ["pass"], min_width=9)]
    assert column_widths(columns, 30) == [22, 6]  # narrowed to fit; "result" not widened to 9


def test_progress_line_fits() -> None:
    assert progress_line(3, 18, _case("t5", kept=4), 100) == "[3/18] t5 fp16 autocast ... pass"
    long = progress_line(1, 2, _case("a.very.long.module.name:factory" * 4, kept=1), 60)
    assert len(long) == 60
    assert long.endswith("... ... pass")


def test_the_ranks_record_torchs_view_warning_and_print_every_other() -> None:
    from pytest_fp32keep.check.ranks import ViewWarnings

    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        with ViewWarnings() as recorded:
            for _ in range(3):
                warnings.warn(
                    "FSDP2-wrapped module (FSDPT5Block) returned a view tensor. An in-place op",
                    UserWarning,
                    stacklevel=1,
                )
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert recorded.counts == {"FSDPT5Block": 3}
    assert shown == ["something else"]


#: What torch 2.9's gloo printed in each rank of a real run (docs/matrix.md, torch-2.9).
GLOO_CONNECTED_LINE = (
    b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
)


def test_the_rank_output_filter_drops_glooS_connection_line_and_nothing_else() -> None:
    from pytest_fp32keep.check.rank_output import LineFilter

    short = GLOO_CONNECTED_LINE.replace(b"Rank 0 is connected to 1", b"Rank 1 is connected to 0")
    last = GLOO_CONNECTED_LINE.replace(b"Rank 0", b"Rank 1").rstrip(b"\n")  # no newline yet
    text = (
        b"[1/2] family/gpt_oss fp16 autocast ... pass\n"
        + GLOO_CONNECTED_LINE
        + short  # a rank short of peers is no noise
        + b"[Gloo] Rank 1 is NOT connected to: [0]\n"
        + last
    )
    kept = b"[1/2] family/gpt_oss fp16 autocast ... pass\n" + short
    kept += b"[Gloo] Rank 1 is NOT connected to: [0]\n"
    whole = LineFilter()
    assert whole.feed(text) + whole.end() == kept
    # as gloo writes it, a piece at a time: the same, and a plain partial line goes out at once
    pieces = LineFilter()
    assert b"".join(pieces.feed(text[i : i + 1]) for i in range(len(text))) + pieces.end() == kept
    live = LineFilter()
    assert live.feed(b"loading") == b"loading"
    assert live.feed(b" [Gloo] is mine\n[Gl") == b" [Gloo] is mine\n"
    assert live.end() == b"[Gl"


def test_the_ranks_stdout_reaches_the_user_without_glooS_connection_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Through the real file descriptor, C's stdio included (gloo writes with C++'s cout)."""
    import ctypes

    from pytest_fp32keep.check.rank_output import GlooConnectedLines

    libc = ctypes.CDLL(None)
    with GlooConnectedLines():
        print("before", flush=True)
        os.write(1, GLOO_CONNECTED_LINE)
        libc.printf(b"from C, buffered\n")  # in C's buffer: flushed on leaving at the latest
        # One write: under capfd, Python's stdout writes to the capture file directly while C's
        # line arrives through the pipe's copying thread, which may land between the two
        # writes of a print() ("after", then "\n"): lines interleave, they must not tear.
        sys.stdout.write("after\n")
    out, _ = capfd.readouterr()
    assert out.startswith("before\n")  # Python's and C's buffers interleave as they flush
    assert sorted(out.splitlines()) == ["after", "before", "from C, buffered"]


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
#: ``fp32keep check`` imports it from the current directory.
USER_MODULE = """
from transformers import T5Config, T5ForConditionalGeneration


def build():
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, dropout_rate=0.0)
    return T5ForConditionalGeneration(config)
"""


def _environment(**overrides: str) -> dict[str, str]:
    """This process's environment without COLUMNS (the command's width is its own default)."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    env.update(overrides)
    return env


def run_cli_in_terminal(
    *argv: str, columns: int, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the console script with stdout on a pseudo-terminal ``columns`` wide (stderr to a
    file, to tell them apart); the terminal's output with ``\\n`` line ends."""
    assert CONSOLE_SCRIPT.exists(), f"the console script is not installed at {CONSOLE_SCRIPT}"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        with contextlib.suppress(OSError):  # EIO once every writer has closed the terminal
            while data := os.read(master, 65536):
                chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with tempfile.TemporaryFile("w+") as err:
        try:
            completed = subprocess.run(
                [str(CONSOLE_SCRIPT), "check", *argv],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=slave,
                stderr=err,
                text=True,
                timeout=900,
                check=False,
            )
        finally:
            os.close(slave)
            reader.join(timeout=30)
            os.close(master)
        err.seek(0)
        out = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
        return subprocess.CompletedProcess(completed.args, completed.returncode, out, err.read())


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
        "10",
        env=env,
    )
    assert completed.returncode == 1
    assert "did not finish within --timeout 10 s and were killed" in completed.stderr
    assert killed_leftovers(mark) == [], "a rank of the timed-out check was still running"
    # stdout is a file: no progress lines, the default width
    assert "[1/1]" not in completed.stdout
    if completed.stdout.strip():
        _check_fits(completed.stdout, 100)


# --- two real runs, as a user meets them --------------------------------------------------------
# Each real run costs a torchrun and a Transformers import in every rank: the checks share two.


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's folder outside the repository, holding their own module."""
    folder = tmp_path_factory.mktemp("user-project")
    (folder / "mymodels.py").write_text(USER_MODULE)
    return folder


def _terminal_run(user_folder: Path) -> subprocess.CompletedProcess[str]:
    """The installed console script in an 80-column terminal, from the user's folder: their
    Transformers model (the default token batch) and a family from its shrunk config, fp16."""
    env = _environment()
    env.pop("OMP_NUM_THREADS", None)
    return run_cli_in_terminal(
        "mymodels:build", "--family", "gpt_oss", "--dtype", "fp16",
        columns=80, cwd=user_folder, env=env,
    )  # fmt: skip


#: The targets of :func:`_file_run`: the project's toys (one printing and warning in the ranks,
#: one refused, one differing on rank 1), with ``--batch``.
FILE_RUN_TARGETS = (
    "tests.cli.targets:noisy_stack",
    "tests.cli.targets:kept_stack",
    "tests.cli.targets:root_owned",
    "tests.cli.rank_targets:differs_on_rank_1",
)


def _file_run(user_folder: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The console script with stdout to a file (as CI runs it), the project's toys on
    ``PYTHONPATH``, fp16, a Markdown and a JSON report."""
    report = user_folder / "summary.md"
    completed = run_cli(
        *FILE_RUN_TARGETS,
        *("--batch", "tests.cli.targets:toy_batch", "--dtype", "fp16", "--report", str(report)),
        cwd=user_folder,
        env=_environment(PYTHONPATH=str(ROOT)),
    )
    return completed, report


@pytest.fixture(scope="module")
def real_runs(user_folder: Path) -> dict[str, Any]:
    """Both runs, started together (each mostly waits for its ranks to start)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        terminal = pool.submit(_terminal_run, user_folder)
        file = pool.submit(_file_run, user_folder)
        return {"terminal": terminal.result(), "file": file.result()}


@pytest.fixture
def terminal_run(real_runs: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    completed: subprocess.CompletedProcess[str] = real_runs["terminal"]
    return completed


@pytest.fixture
def file_run(real_runs: dict[str, Any]) -> tuple[subprocess.CompletedProcess[str], Path]:
    run: tuple[subprocess.CompletedProcess[str], Path] = real_runs["file"]
    return run


def test_the_console_script_imports_a_users_module_from_the_current_directory(
    terminal_run: subprocess.CompletedProcess[str],
) -> None:
    out = terminal_run.stdout
    assert terminal_run.returncode == 0, out[-3000:] + terminal_run.stderr[-3000:]
    assert "2 passed, 0 failed" in out
    assert "mymodels:build fp16 autocast ... pass" in out
    assert "    kept 4: stored float32, all-gathered float32" in out  # T5's four `wo` weights


def torch_warns_of_view_outputs() -> bool:
    """Whether the installed torch's FSDP2 warns of a unit returning a view tensor (T5 does):
    torch 2.13 and 2.14 do (``_fsdp_state.py``), torch 2.9.1 has no such warning (read from the
    module's source, the warning's only place)."""
    spec = importlib.util.find_spec("torch.distributed.fsdp._fully_shard._fsdp_state")
    assert spec is not None and spec.origin is not None
    return "returned a view tensor" in Path(spec.origin).read_text(encoding="utf-8")


def test_terminal_header_legend_width_progress_and_torch_noise(
    terminal_run: subprocess.CompletedProcess[str],
) -> None:
    """Progress per case, the header (no commit outside a repository), a table that fits the
    terminal, the legend, torch's view-tensor warning summarised once."""
    out, err = terminal_run.stdout, terminal_run.stderr
    _check_fits(out, 80)
    assert "fp32keep check: running 2 cases in 2 ranks" in out
    assert "[1/2] family/gpt_oss fp16 autocast ... pass" in out
    assert "[2/2] mymodels:build fp16 autocast ... pass" in out
    header = " ".join(out.split("\n\n")[1].split())
    assert header.startswith("fp32keep check: 2 ranks on gloo (cpu), OMP_NUM_THREADS=1")
    assert "torch 2." in header
    assert "transformers " in header
    assert "commit" not in header  # the current directory is no git repository
    assert "legend: stored = dtype at rest; gather = dtype when all-gathered" in out
    # torch's noise: one note, not a copy per rank; torchrun's OMP banner not at all
    if torch_warns_of_view_outputs():
        assert out.count("torch warned") == 1
        assert "FSDP2-wrapped module returned a view tensor (FSDPT5Block" in " ".join(out.split())
    else:
        assert "torch warned" not in out  # nothing to summarise
    assert "returned a view tensor" not in err
    assert "Setting OMP_NUM_THREADS" not in out + err


def test_the_commit_is_the_current_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the repository the header names its commit; outside one, none (the run above)."""
    from pytest_fp32keep.check.cli import _commit

    monkeypatch.chdir(ROOT)
    expected = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    assert _commit() == (expected or None)
    monkeypatch.chdir(tmp_path)
    assert _commit() is None


def test_a_failing_case_exits_1_and_the_file_output_fits_without_progress(
    file_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    completed, _ = file_run
    out = completed.stdout
    # refused root_owned, differs_on_rank_1 (rank 1): a user's model is not expected to fail
    assert completed.returncode == 1, out[-3000:] + completed.stderr[-3000:]
    assert "2 passed, 2 failed" in out
    assert out.startswith("fp32keep check: 2 ranks on ")  # no progress lines: not a terminal
    assert "[1/4]" not in out
    lines = out.splitlines()
    _check_fits("\n".join(line for line in lines if not line.startswith("wrote ")), 100)


def test_what_the_ranks_print_and_warn_reaches_the_user(
    file_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """What fp32keep check does not know still reaches the user, from every rank."""
    completed, _ = file_run
    assert completed.stderr.count(NOISY_LINE) >= 2
    assert f"UserWarning: {NOISY_WARNING}" in completed.stderr


def test_reports_hold_every_case_and_the_refusal(
    file_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    completed, report = file_run
    markdown = report.read_text()
    assert "| tests.cli.targets:kept_stack | fp16 | autocast | pass |" in markdown
    assert "FAIL (refused)" in markdown
    assert "[root-owned]" in markdown
    data = json.loads(report.with_suffix(".json").read_text())
    (kept,) = [c for c in data["cases"] if c["target"] == "tests.cli.targets:kept_stack"]
    assert {row["fqn"] for row in kept["kept"]} == {"layers.0.wo.weight", "layers.1.wo.weight"}
    assert {row["stored"] for row in kept["kept"]} == {"float32"}
    assert data["nproc"] == 2
    assert data["backend"] == "gloo"
    assert data["master_dtype"] is None  # no --master-dtype: low-precision storage
    assert "2 ranks on gloo (cpu)" in markdown
    assert "stored = dtype at rest; materialized = dtype when all-gathered" in markdown
    written = f"wrote Markdown: {report}\nwrote JSON: {report.with_suffix('.json')}"
    assert written in completed.stdout
    # the refused case's details, in the terminal too, within the width (paths are not cut)
    assert "tests.cli.targets:root_owned fp16 autocast: FAIL (refused)" in completed.stdout


def test_a_model_that_differs_on_rank_1_fails_there_alone(
    file_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Every rank's verdict merged (tests/cli/test_rank_verdicts.py): rank 0's alone passes."""
    completed, report = file_run
    out = " ".join(completed.stdout.split())
    assert "FAIL (rank 1)" in out
    assert "ranks disagree: rank 1: fail (round trip); rank 0: pass" in out
    data = json.loads(report.with_suffix(".json").read_text())
    target = "tests.cli.rank_targets:differs_on_rank_1"
    (case,) = [c for c in data["cases"] if c["target"] == target]
    assert case["ok"] is False and case["ranks_agree"] is False and case["failed_ranks"] == [1]
    outcomes = {o["rank"]: o for o in case["rank_outcomes"]}
    assert outcomes[0]["ok"] is True and outcomes[0]["outcome"] == "pass"
    assert outcomes[1]["outcome"] == "fail" and outcomes[1]["failed_checks"] == ["round trip"]
    assert [f["ranks"] for f in case["failures"]] == [[1]]


@pytest.mark.slow  # one more torchrun; the default tier's file run above checks the null
def test_the_report_names_the_master_dtype_it_judged(tmp_path: Path) -> None:
    """``--master-dtype fp32`` is recorded in the JSON report (docs/families.md sorts reports
    into conventions by it); the run above, without the option, records ``null``."""
    report = tmp_path / "masters.json"
    completed = run_cli(
        "tests.cli.targets:kept_stack",
        *("--batch", "tests.cli.targets:toy_batch", "--dtype", "fp16", "--master-dtype", "fp32"),
        *("--report-json", str(report)),
        cwd=tmp_path,
        env=_environment(PYTHONPATH=str(ROOT)),
    )
    assert report.is_file(), completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["master_dtype"] == "fp32"
    assert [case["target"] for case in data["cases"]] == ["tests.cli.targets:kept_stack"]
