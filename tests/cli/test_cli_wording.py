"""What ``fp32keep`` prints when a user gets the command line wrong (issue 36, item 6).

A bad value is one line saying what is wrong and one pointing at ``--help``, not argparse's
6-line usage block first; a TARGET without a colon is told how to name a model of its own; the
top-level ``--help`` reads as text, without reStructuredText's literal marks. In-process, no
rank starts.
"""

from __future__ import annotations

import pytest

from pytest_fp32keep.check.cli import main
from tests.error_bounds import PARENT_BOUND_S, within


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The stderr lines of ``fp32keep ARGV``, a usage error (exit status 2)."""
    with within(PARENT_BOUND_S), pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("argv", "prog", "message"),
    [
        (["check", "--nproc", "0"], "fp32keep check", "argument --nproc: --nproc must be at least"),
        (["check", "--dtype", "fp8"], "fp32keep check", "argument --dtype: --dtype takes a comma"),
        # argparse finds an unknown option at the top level, after the subcommand's parse
        (["check", "--no-such-option"], "fp32keep", "unrecognized arguments: --no-such-option"),
    ],
)
def test_a_bad_value_is_its_one_line_then_where_the_options_are(
    argv: list[str], prog: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _error(argv, capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{prog}: error: ") and message in lines[0], lines
    assert lines[1] == f"({prog} --help lists the options)"
    assert not any(line.startswith("usage:") for line in lines)  # no usage block


def test_a_missing_command_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _error([], capsys)
    assert lines == [
        "fp32keep: error: the following arguments are required: command",
        "(fp32keep --help lists the options)",
    ]


def test_help_still_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    # negative control: --help is where the usage is (and exits 0)
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: fp32keep check")


def test_the_top_level_help_has_no_rst_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out, out
    assert "fp32keep check: run the FP32-keep contract on the zoo or on your models" in " ".join(
        out.split()
    )


def test_a_target_without_a_colon_is_told_how_to_name_a_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with within(PARENT_BOUND_S):
        assert main(["check", "my_models.build_model"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown zoo entries ['my_models.build_model']" in err
    assert "package.module:factory" in err and "e.g. my_models:build_model" in err
    # negative control: a zoo name is not an error, and gets no such hint
    assert main(["check", "--list"]) == 0
    assert "package.module:factory" not in capsys.readouterr().err
