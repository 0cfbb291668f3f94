"""``fp32keep check``: run the FP32-keep contract on the zoo or on your models, in N ranks.

    fp32keep check [TARGET ...] [--nproc N] [--dtype bf16,fp16] [--context autocast,direct]
                   [--prefetch] [--master-dtype fp32] [--measure-spread] [--expect-kept N]
                   [--batch MODULE:FUNCTION] [--cast MODULE:FUNCTION] [--shard MODULE:FUNCTION]
                   [--load MODULE:FUNCTION|none] [--policy MODULE:FUNCTION]
                   [--report FILE.md] [--report-json FILE.json]
                   [--timeout SECONDS] [--launcher auto|local|external]

A TARGET is a zoo name (``fp32keep check --list`` shows them) or ``package.module:factory``, a
zero-argument function returning an ``nn.Module``. ``--family NAME`` (repeatable; a folder under
``transformers/models``) and ``--all-families`` add Transformers model families, built from
automatically shrunk configs (:mod:`pytest_fp32keep.check.families`); a family that does not
build is a ``not buildable (reason)`` note, not a crash; ``--list --all-families`` lists them with
whether each builds. ``--cast``, ``--shard``, ``--load`` and ``--policy`` plug a framework's own
steps into every case (:mod:`.plugins`). Exit status: 0 when every case passes, 1 when
one does not, 2 for a usage error, a bad TARGET or a bad plug-in.

Everything a user can get wrong on the command line (options, TARGETs, report paths) is found
here, before any rank starts. The ranks write to this command's stdout and stderr (see
:mod:`.ranks` for the one torch warning they summarise instead); the report comes after them,
fitted to the terminal (:mod:`.render`, :mod:`.layout`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from pytest_fp32keep.check.arguments import build_parser, versions
from pytest_fp32keep.check.in_place import launched_world, run_in_place
from pytest_fp32keep.check.layout import terminal_width
from pytest_fp32keep.check.render import render_markdown, render_text
from pytest_fp32keep.runner.processes import TorchrunProcess


def _commit() -> str | None:
    """The short commit of the current directory's git repository; ``None`` if there is none,
    git is missing or slow."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _threads(env: dict[str, str], nproc: int) -> str | None:
    """Set ``OMP_NUM_THREADS`` in ``env`` as torchrun would (1 for several ranks), and say so.

    torchrun sets it itself when it is unset, behind a banner of asterisks printed beside the
    report; setting the same value here spares that banner, and the report's header says it.
    """
    if "OMP_NUM_THREADS" in env:
        return f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    if nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
        return "OMP_NUM_THREADS=1 (torchrun's default)"
    return None


def _launch(spec: dict[str, Any], nproc: int, timeout: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fp32keep-check-") as work:
        spec_path, out_path = Path(work, "spec.json"), Path(work, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        }
        threads = _threads(env, nproc)
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
        result["threads"] = threads
        return result


UsageError = Callable[[str], NoReturn]


def _validate_options(args: argparse.Namespace, usage_error: UsageError) -> None:
    """What no single option can check: how options combine with each other and the TARGETs."""
    if args.batch is not None and not any(":" in target for target in args.targets):
        checked = ", ".join(args.targets) if args.targets else "the whole zoo"
        usage_error(
            f"--batch applies to package.module:factory TARGETs only; zoo entries ({checked}) "
            "build their own batches: drop --batch, or name your module:factory TARGET"
        )
    report, report_json = args.report, args.report_json
    if report is not None and report_json is not None and report.resolve() == report_json.resolve():
        usage_error("--report and --report-json name the same file: give them two names")


def _report_paths(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The Markdown and JSON files to write: JSON beside the Markdown unless named."""
    json_path = args.report_json
    if json_path is None and args.report is not None:
        json_path = args.report.with_suffix(".json")
    return args.report, json_path


def _write_reports(args: argparse.Namespace, result: dict[str, Any]) -> str | None:
    """Write the reports asked for; an error message if one cannot be written."""
    markdown, json_path = _report_paths(args)
    try:
        if markdown is not None:
            markdown.write_text(render_markdown(result))
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=2))
    except OSError as error:
        return f"cannot write the report: {error}"
    return None


def check(args: argparse.Namespace, usage_error: UsageError) -> int:
    """Validate options and targets here, run every case in the ranks, print and write the
    report."""
    from pytest_fp32keep.check.plugins import Plugins, resolve_plugins
    from pytest_fp32keep.check.ranks import DTYPES
    from pytest_fp32keep.check.targets import (
        TargetError,
        family_spec,
        family_targets,
        resolve_targets,
    )

    _validate_options(args, usage_error)
    try:
        world = launched_world(args.launcher)
    except ValueError as error:
        usage_error(str(error))
    nproc = args.nproc if world is None else world.world_size
    quiet = world is not None and world.rank != 0  # under a launcher, rank 0 alone prints
    # The ranks import a TARGET with the current directory on their path (``python -m`` and
    # PYTHONPATH, see _launch); the console script's own path lacks it. Validate the same way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        plugins = Plugins.from_args(args)
        resolve_plugins(plugins, [DTYPES[name] for name in args.dtype])  # before any rank
        families, not_buildable = _families(args)
        targets, unavailable = (
            resolve_targets(args.targets, args.batch)
            if args.targets or not _families_asked(args)
            else ([], {})
        )
        targets += family_targets(families)
    except TargetError as error:
        print(f"fp32keep check: error: {error}", file=sys.stderr)
        return 2
    unavailable = {**unavailable, **not_buildable}
    if not targets and not_buildable:  # families asked for, none builds: their rows, no ranks
        for name, reason in not_buildable.items():
            print(f"{name}: {reason}")
        print(f"\n0 passed, 0 failed, {len(not_buildable)} not buildable")
        return 1
    if not targets:
        print("fp32keep check: error: no target is available to check", file=sys.stderr)
        return 2
    width = terminal_width()
    progress = sys.stdout.isatty() and not quiet
    spec = {
        "targets": [*args.targets, *(family_spec(name) for name in families)],
        "batch": args.batch,
        "plugins": plugins.to_dict(),
        "dtypes": args.dtype,
        "autocast": [context == "autocast" for context in args.context],
        "prefetch": [False, True] if args.prefetch else [False],
        "master_dtype": args.master_dtype,
        "measure_spread": args.measure_spread,
        "expect_kept": args.expect_kept,
        "progress": progress,
        "width": width,
    }
    if progress:
        total = len(targets) * len(args.dtype) * len(args.context) * len(spec["prefetch"])
        cases = f"{total} case{'s' if total != 1 else ''}"
        ranks = f"{nproc} rank{'s' if nproc != 1 else ''}"
        print(f"fp32keep check: running {cases} in {ranks}", flush=True)
    started = time.monotonic()
    try:
        if world is None:
            result = _launch(spec, args.nproc, args.timeout)
        elif (ours := run_in_place(spec, world)) is not None:
            result = ours
        else:
            return 0  # not rank 0: rank 0 holds every rank's verdicts and reports them
    except RuntimeError as error:
        print(f"fp32keep check: error: {error}", file=sys.stderr)
        return 1
    result.update(
        nproc=nproc,
        master_dtype=args.master_dtype,  # the convention judged: docs/families.md sorts by it
        versions=versions(),
        commit=_commit(),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        seconds=round(time.monotonic() - started, 1),
        unavailable=dict(unavailable),
        plugins=plugins.to_dict(),
    )
    print(("\n" if progress else "") + render_text(result, width))
    failed = sum(1 for case in result["cases"] if not case["ok"])
    problem = _write_reports(args, result)
    print(f"\n{len(result['cases']) - failed} passed, {failed} failed")
    if problem is not None:  # the folder vanished or filled up during the run
        print(f"fp32keep check: error: {problem}", file=sys.stderr)
        return 2
    for kind, path in zip(("Markdown", "JSON"), _report_paths(args), strict=True):
        if path is not None:  # never wrapped: a path must stay one string to copy
            print(f"wrote {kind}: {path}")
    return 1 if failed else 0


def _families_asked(args: argparse.Namespace) -> bool:
    return bool(args.family) or bool(args.all_families)


def _families(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The families asked for that build, and ``not buildable (reason)`` for the others.

    Unknown names raise :class:`~pytest_fp32keep.check.targets.TargetError` before anything
    is built; each family is built and run once, unsharded, to tell whether it builds.
    """
    if not _families_asked(args):
        return [], {}
    from pytest_fp32keep.check.families import keep_families
    from pytest_fp32keep.check.targets import family_availability

    names = list(keep_families()) if args.all_families else []
    names = list(dict.fromkeys([*names, *args.family]))
    buildable, unavailable = family_availability(names)
    return buildable, dict(unavailable)


def _list_families(args: argparse.Namespace) -> int:
    """``--list`` with families: each family, its class, and whether it builds."""
    from pytest_fp32keep.check.families import family_entry
    from pytest_fp32keep.check.targets import TargetError

    try:
        buildable, unavailable = _families(args)
    except TargetError as error:
        print(f"fp32keep check: error: {error}", file=sys.stderr)
        return 2
    for name in buildable:
        print(f"family/{name}  ({family_entry(name).notes.split()[0]}: builds)")
    for name, reason in unavailable.items():
        print(f"{name}  ({reason})")
    return 0


#: The exit status of a command ended by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fp32keep`` console script.

    Ctrl-C ends it with one line and exit status 130, no traceback: the ranks are already
    killed on the way out (:func:`_launch` kills them whatever ends the wait).
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nfp32keep check: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.list and _families_asked(args):
        return _list_families(args)
    if args.list:
        from pytest_fp32keep.check.ranks import DTYPES
        from pytest_fp32keep.check.targets import zoo_targets

        targets, unavailable = zoo_targets()
        for target in targets:
            refused = [name for name, dtype in DTYPES.items() if target.refusal_expected(dtype)]
            note = f"  (expects KeepLayoutError at {', '.join(refused)})" if refused else ""
            print(f"{target.name}{note}")
        for name, reason in unavailable.items():
            print(f"{name}  (unavailable: {reason})")
        return 0
    return check(args, args.usage_error)


if __name__ == "__main__":
    raise SystemExit(main())
