"""The README's claims about ``fp32keep check``'s options hold: its synopsis lists options the
command has (the plug-ins among them), its accelerate reproducer parses and names functions that
exist, and the error it quotes for a bad ``--shard`` is the one the command prints.

Static or in-process; no rank starts (``_launch`` is made to fail the test if it is reached).
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_fp32keep.check import cli
from pytest_fp32keep.check.arguments import build_parser
from tests.error_bounds import PARENT_BOUND_S, within

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PLUG_INS = {"--cast", "--shard", "--load", "--policy"}


def synopsis(readme: str) -> str:
    """The code block under ``## `fp32keep check```` that starts ``fp32keep check [TARGET``."""
    found = re.search(r"```\n(fp32keep check \[TARGET.*?)```", readme, re.DOTALL)
    assert found, "the README's fp32keep check synopsis block is missing"
    return found.group(1)


def check_options() -> set[str]:
    """Every option string of ``fp32keep check``."""
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    check = commands.choices["check"]
    return {option for action in check._actions for option in action.option_strings}


def unknown_options(block: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]*", block)) - check_options()


def test_the_synopsis_lists_only_real_options_and_the_plug_ins() -> None:
    block = synopsis(README)
    assert unknown_options(block) == set()
    assert set(re.findall(r"--[a-z][a-z-]*", block)) >= PLUG_INS
    assert "[--load MODULE:FUNCTION|none]" in block
    # negative control: an option the command does not have is caught
    assert unknown_options(block + " [--sharded MODULE:FUNCTION]") == {"--sharded"}


def reproducer(readme: str) -> list[str]:
    """The README's accelerate one-liner, as the shell splits it."""
    found = re.search(r"```\n(fp32keep check deepseek_v3 .*?)```", readme, re.DOTALL)
    assert found, "the README's accelerate reproducer is missing"
    return shlex.split(found.group(1).replace("\\\n", " "))


def defined_functions(module: str) -> set[str]:
    """The top-level functions of a module of this repository, read without importing it
    (accelerate need not be installed here)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_accelerate_reproducer_parses_and_names_real_functions() -> None:
    argv = reproducer(README)
    assert argv[:2] == ["fp32keep", "check"]
    args = build_parser().parse_args(argv[1:])
    assert args.targets == ["deepseek_v3"] and args.master_dtype == "fp32"
    named = {"--shard": args.shard, "--load": args.load, "--policy": args.policy}
    for option, value in named.items():
        module, _, function = value.partition(":")
        assert function in defined_functions(module), f"{option} {value}: no such function"
    # negative control: a misspelt function is caught
    assert "accelerate_shards" not in defined_functions(module)


def quoted_shard_error(readme: str) -> str:
    """The error the README quotes for a ``--shard`` of the wrong signature."""
    found = re.search(r'e\.g\. "(--shard\s.*?)"\. The report', readme, re.DOTALL)
    assert found, "the README's quoted --shard error is missing"
    return " ".join(found.group(1).split())


def test_the_quoted_shard_error_is_the_commands(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "fw.py").write_text("def shard(model, mesh):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fw", raising=False)

    def launch(*args: object) -> dict[str, Any]:
        raise AssertionError("ranks were started for a shard that should have been refused")

    monkeypatch.setattr(cli, "_launch", launch)
    with within(PARENT_BOUND_S):
        assert cli.main(["check", "t5", "--dtype", "fp16", "--shard", "fw:shard"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err == f"fp32keep check: error: {quoted_shard_error(README)}"
