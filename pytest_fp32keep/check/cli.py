"""``fp32keep check``: run the FP32-keep contract on the zoo or on your models, in N ranks.

    fp32keep check [TARGET ...] [--nproc N] [--dtype bf16,fp16] [--context autocast,direct]
                   [--prefetch] [--batch MODULE:FUNCTION] [--report FILE] [--timeout SECONDS]

A TARGET is a zoo name (``fp32keep check --list`` shows them) or ``package.module:factory``, a
zero-argument function returning an ``nn.Module``. Exit status: 0 when every case passes, 1 when
one does not, 2 for a usage error or a bad TARGET.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from pytest_fp32keep.check.render import case_details, case_result, render_markdown, render_text
from pytest_fp32keep.runner.processes import TorchrunProcess

DTYPE_CHOICES = ("bf16", "fp16")
CONTEXT_CHOICES = ("autocast", "direct")


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


def build_parser() -> argparse.ArgumentParser:
    """The ``fp32keep`` command line."""
    parser = argparse.ArgumentParser(prog="fp32keep", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_versions()['pytest-fp32keep']}",
        help="print the installed pytest-fp32keep version and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check",
        help="run the FP32-keep contract in N ranks and print a table",
        description="Run the FP32-keep contract on the built-in zoo (default) or on TARGETs.",
    )
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
        help="run forward under autocast, directly, or both (default autocast)",
    )
    check.add_argument("--prefetch", action="store_true", help="also run with forward prefetch on")
    check.add_argument("--batch", metavar="MODULE:FUNCTION", help="builds a batch from the model")
    check.add_argument(
        "--report", type=Path, metavar="FILE", help="write Markdown to FILE and JSON beside it"
    )
    check.add_argument(
        "--timeout",
        type=_positive_int("--timeout"),
        default=1800,
        help="seconds before the ranks are killed (default 1800)",
    )
    check.add_argument("--list", action="store_true", help="list the zoo entries and exit")
    return parser


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("torch", "transformers", "pytest-fp32keep"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _launch(spec: dict[str, Any], nproc: int, timeout: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fp32keep-check-") as work:
        spec_path, out_path = Path(work, "spec.json"), Path(work, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        }
        process = TorchrunProcess.spawn(
            nproc,
            "pytest_fp32keep.check.ranks",
            [str(spec_path), str(out_path)],
            work_dir=Path(work),
            env=env,
        )
        try:
            code = process.wait(timeout)
        finally:
            # Also on Ctrl-C and on a timeout: no rank may outlive the command.
            process.kill()
        if code is None:
            raise RuntimeError(
                f"the ranks did not finish within --timeout {timeout} s and were killed"
            )
        if code != 0 or not out_path.exists():
            raise RuntimeError(
                f"the ranks failed (torchrun exit status {code}); see the output above"
            )
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result


def check(args: argparse.Namespace) -> int:
    """Validate the targets here, run every case in the ranks, print and write the report."""
    from pytest_fp32keep.check.targets import TargetError, resolve_targets

    # The ranks import a TARGET with the current directory on their path (``python -m`` and
    # PYTHONPATH, see _launch); the console script's own path lacks it. Validate the same way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        targets, unavailable = resolve_targets(args.targets, args.batch)
    except TargetError as error:
        print(f"fp32keep check: error: {error}", file=sys.stderr)
        return 2
    if not targets:
        print("fp32keep check: error: no target is available to check", file=sys.stderr)
        return 2
    spec = {
        "targets": args.targets,
        "batch": args.batch,
        "dtypes": args.dtype,
        "autocast": [context == "autocast" for context in args.context],
        "prefetch": [False, True] if args.prefetch else [False],
    }
    started = time.monotonic()
    try:
        result = _launch(spec, args.nproc, args.timeout)
    except RuntimeError as error:
        print(f"fp32keep check: error: {error}", file=sys.stderr)
        return 1
    result.update(
        nproc=args.nproc,
        versions=_versions(),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        seconds=round(time.monotonic() - started, 1),
        unavailable=dict(unavailable),
    )
    print(render_text(result["cases"]))
    for name, reason in unavailable.items():
        print(f"not checked: {name}: {reason}")
    for case in result["cases"]:
        if not case["ok"]:
            print(f"\n{case['target']} {case['dtype']} ({case['context']}): {case_result(case)}")
            print("\n".join(case_details(case)))
    if args.report is not None:
        args.report.write_text(render_markdown(result))
        args.report.with_suffix(".json").write_text(json.dumps(result, indent=2))
    failed = sum(1 for case in result["cases"] if not case["ok"])
    print(f"\n{len(result['cases']) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fp32keep`` console script."""
    args = build_parser().parse_args(argv)
    if args.list:
        from pytest_fp32keep.check.targets import zoo_targets

        targets, unavailable = zoo_targets()
        for target in targets:
            note = "  (expects KeepLayoutError where its plan keeps anything)"
            note = note if target.expect_layout_error else ""
            print(f"{target.name}{note}")
        for name, reason in unavailable.items():
            print(f"{name}  (unavailable: {reason})")
        return 0
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
