"""``fp32keep check``'s command line: its options, and the checks argparse runs on each value.

Every value a user can get wrong (a dtype, a number of ranks, a report path) is refused here by
argparse as a usage error naming the option, before any rank starts (:mod:`.cli` runs the rest).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from pytest_fp32keep.check.in_place import LAUNCHERS

DTYPE_CHOICES = ("bf16", "fp16")
CONTEXT_CHOICES = ("autocast", "direct")
#: ``--master-dtype``: the storage convention the ranks judge (see ranks.MASTER_DTYPES).
MASTER_DTYPE_CHOICES = ("fp32",)


def _csv(choices: Sequence[str], option: str) -> Any:
    def parse(text: str) -> list[str]:
        values = [value.strip() for value in text.split(",") if value.strip()]
        bad = [value for value in values if value not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"{option} takes a comma-separated list of {', '.join(choices)}; got {text!r}"
            )
        return list(dict.fromkeys(values))

    return parse


def _positive_int(option: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option} must be a whole number, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be at least 1, got {value}")
        return value

    return parse


def _positive_float(option: str) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be a number, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{option} must be above 0 and finite, got {text}")
        return value

    return parse


def _report_path(option: str, suffix: str, other: str) -> Any:
    """An argparse type: a file ``option`` can write, in a folder that exists, named so that
    it is not mistaken for the other report (``suffix`` is the wrong one)."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.suffix.lower() == suffix:
            raise argparse.ArgumentTypeError(
                f"{text!r} ends in {suffix}, but {option} writes "
                f"{'Markdown' if option == '--report' else 'JSON'}: use {other} {text!r} for "
                f"that, or give {option} a file ending in "
                f"{'.md' if option == '--report' else '.json'}"
            )
        if text.endswith(("/", os.sep)) or path.is_dir():
            raise argparse.ArgumentTypeError(
                f"{text!r} is a folder; name a file in it, e.g. "
                f"{str(path / ('summary.md' if option == '--report' else 'summary.json'))!r}"
            )
        folder = path.parent
        if not folder.exists():
            raise argparse.ArgumentTypeError(
                f"the folder {str(folder)!r} does not exist: create it first "
                f"(mkdir -p {folder}) or write the report elsewhere"
            )
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{str(folder)!r} is not a folder")
        try:  # os.access says yes to root on a read-only file system: try it
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            raise argparse.ArgumentTypeError(
                f"cannot write in the folder {str(folder)!r} ({error.strerror or error}): "
                "choose a folder you can write to"
            ) from None
        return path

    return parse


DESCRIPTION = "fp32keep check: run the FP32-keep contract on the zoo or on your models, in N ranks."
"""What ``fp32keep --help`` says the command does (plain text: argparse prints it as is)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are the one line that says what is wrong (and where the
    options are listed), not the whole usage block before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``fp32keep`` command line (its subcommands' parsers are :class:`_Parser` s too)."""
    parser = _Parser(prog="fp32keep", description=DESCRIPTION)
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {versions()['pytest-fp32keep']}",
        help="print the installed pytest-fp32keep version and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check",
        help="run the FP32-keep contract in N ranks and print a table",
        description="Run the FP32-keep contract on the built-in zoo (default) or on TARGETs.",
    )
    _case_arguments(check)
    _plugin_arguments(check)
    _run_arguments(check)
    _family_arguments(check)
    check.set_defaults(usage_error=check.error)  # errors that need several options at once
    return parser


def _case_arguments(check: argparse.ArgumentParser) -> None:
    """What is checked and how: the targets, ranks, dtypes, forward context, master weights."""
    check.add_argument(
        "targets", nargs="*", metavar="TARGET", help="zoo name or package.module:factory"
    )
    check.add_argument(
        "--nproc", type=_positive_int("--nproc"), default=2, help="ranks (default 2)"
    )
    check.add_argument(
        "--dtype",
        type=_csv(DTYPE_CHOICES, "--dtype"),
        default=list(DTYPE_CHOICES),
        help="low-precision dtypes (default bf16,fp16)",
    )
    check.add_argument(
        "--context",
        type=_csv(CONTEXT_CHOICES, "--context"),
        default=["autocast"],
        help="run forward under torch.autocast, directly in the stored dtypes, or both "
        "(default autocast: how mixed-precision training usually runs forward; the API's "
        "assert_fp32_keep_contract defaults to autocast=False, see docs/api.md)",
    )
    check.add_argument("--prefetch", action="store_true", help="also run with forward prefetch on")
    check.add_argument(
        "--master-dtype",
        choices=MASTER_DTYPE_CHOICES,
        default=None,
        help="judge FP32 master weights: every trainable parameter stored in FP32, the "
        "policy's param_dtype casts for compute (accelerate, verl, torchtitan); default: "
        "parameters that are not kept stored in --dtype",
    )
    check.add_argument(
        "--measure-spread",
        action="store_true",
        help="run the parity control twice on every case and report how far its two runs "
        "differ (a diagnostic: the control already runs twice wherever a run is not known to "
        "be deterministic; docs/contract.md)",
    )
    check.add_argument(
        "--expect-kept",
        type=_positive_int("--expect-kept"),
        default=None,
        metavar="N",
        help="fail every case that keeps fewer than N tensors in FP32 (a case that keeps "
        "nothing otherwise passes as 'pass (nothing kept)', with a note saying why)",
    )
    check.add_argument(
        "--batch",
        metavar="MODULE:FUNCTION",
        help="function(model) -> batch for the package.module:factory TARGETs (zoo entries "
        "build their own)",
    )


def _run_arguments(check: argparse.ArgumentParser) -> None:
    """Where the report goes, how long the ranks may take and who starts them."""
    check.add_argument(
        "--report",
        type=_report_path("--report", ".json", "--report-json"),
        metavar="FILE.md",
        help="write the report as Markdown to FILE.md, and as JSON beside it (FILE.json) "
        "unless --report-json names the JSON file",
    )
    check.add_argument(
        "--report-json",
        type=_report_path("--report-json", ".md", "--report"),
        metavar="FILE.json",
        help="write the report as JSON to FILE.json",
    )
    check.add_argument(
        "--timeout",
        type=_positive_int("--timeout"),
        default=1800,
        help="seconds before the ranks are killed (default 1800)",
    )
    check.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="who starts the ranks: 'local' (this command starts --nproc of them), 'external' "
        "(every process of a world torchrun or srun launched runs this command; rank 0 prints), "
        "'auto' (external under torchrun, else local; default)",
    )


def _family_arguments(check: argparse.ArgumentParser) -> None:
    """The Transformers families checked beside (or instead of) the zoo."""
    check.add_argument(
        "--family",
        action="append",
        default=[],
        metavar="NAME",
        help="also check the Transformers model family NAME (a folder under "
        "transformers/models, e.g. t5), built from an automatically shrunk config; repeatable",
    )
    check.add_argument(
        "--all-families",
        action="store_true",
        help="check every family of the installed Transformers whose model keeps a tensor",
    )
    check.add_argument(
        "--list",
        action="store_true",
        help="list the zoo entries and exit; with --family/--all-families, list those families "
        "and whether each builds",
    )


def _plugin_arguments(check: argparse.ArgumentParser) -> None:
    """--cast, --shard, --load, --policy: a framework's own steps in every case of the run
    (checked before any rank starts: :mod:`.plugins`)."""
    plugins = check.add_argument_group(
        "your own implementation (each replaces fp32keep's step in every case; default: "
        "fp32keep's own)"
    )
    plugins.add_argument(
        "--cast",
        metavar="MODULE:FUNCTION",
        help="function(model, dtype, plan) that casts the model for low-precision training",
    )
    plugins.add_argument(
        "--shard",
        metavar="MODULE:FUNCTION",
        help="function(model, *, mesh, mp_policy, plan, wrap) that shards it with FSDP2",
    )
    plugins.add_argument(
        "--load",
        metavar="MODULE:FUNCTION|none",
        help="function(model, state_dict) that loads a full state dict held by rank 0 into the "
        "sharded model; 'none': load nothing, the round trip is not judged (frameworks that "
        "load only inside their own from_pretrained)",
    )
    plugins.add_argument(
        "--policy",
        metavar="MODULE:FUNCTION",
        help="function(dtype) -> MixedPrecisionPolicy, called for each --dtype (a function "
        "that takes no argument is called with none); default: MixedPrecisionPolicy("
        "param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)",
    )
    plugins.add_argument(
        "--load-on-every-rank",
        action="store_true",
        help="--load's function takes the full state dict on every rank (default: on rank 0, "
        "None elsewhere)",
    )
    plugins.add_argument(
        "--gradient-divide-factor",
        type=_positive_float("--gradient-divide-factor"),
        default=None,
        metavar="F",
        help="your FSDP2 units divide summed gradients by F instead of the world size (1: "
        "summed, the loss normalised by your code); the contract judges gradients at that scale",
    )


def versions() -> dict[str, str]:
    """The installed torch, Transformers and pytest-fp32keep (``--version``, the report header)."""
    versions = {}
    for package in ("torch", "transformers", "pytest-fp32keep"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions
