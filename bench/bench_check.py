"""``fp32keep check`` on the zoo, this tree against the code before issue 22, in the same run.

    python bench/bench_check.py [--quick] [--rounds N] [--old REV] [--json OUT]

Issue 22's figure: the work that judges by observation (an observed forward before the
reference, deterministic runs, the control's spread, the stuck-peer sampler) must leave
``fp32keep check`` on the zoo within 10% of the wall time it had before (target: new <= 1.10 x
old). The alternative arm is the same command on ``--old`` (default 2132bf1, the main of the day
the issue was filed), extracted with ``git archive`` into ``bench/out/check-REV/`` (git-ignored)
and run from there with ``PYTHONPATH=<tree>:<tree>/impl``; this tree's arm runs the same way from
the repository root. Neither arm uses the installed console script: ``python -m
pytest_fp32keep.check.cli check`` runs from the arm's tree as its current directory, and the
command puts that directory first on its ranks' ``PYTHONPATH``, so the ranks import the same
tree (the venv's editable install only answers imports that ``PYTHONPATH`` does not). Before
timing anything, a probe in each arm's exact environment prints where ``fp32keep`` and
``pytest_fp32keep.check.ranks`` come from and fails unless both are the arm's own tree and the
old arm of the default ``--old`` lacks the observation module (added by issue 22) while this tree
has it; the probe also
writes both trees' bytecode, so neither timed arm compiles it.

Rounds alternate the order (new then old, old then new, ...); each run is timed from spawn to exit
as a user waits for it, and its ``--report-json`` gives the ranks' share (``seconds``). The ratio
is the median of the per-round ratios new / old. Both arms must run the same cases; their
outcomes are compared and any difference is reported (a case that fails in one arm alone makes
the run's figure a comparison of different work). ``--quick`` checks two zoo models at bf16 in
two rounds: it proves the benchmark works, it does not measure the target.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    OUT_DIR,
    ROOT,
    BenchResult,
    Table,
    Target,
    finish,
    fmt,
    load_average,
    median,
    python_env,
    read_json,
    run_timed,
    spread,
)

OLD_REVISION = "2132bf1"
"""main when issue 22 was filed (2026-12-02): the last commit before the issue's work."""
TARGET_RATIO = 1.10
"""Issue 22: ``fp32keep check`` on the zoo within 10% of the wall time before the issue."""
FULL_ROUNDS = 5
QUICK_ROUNDS = 2
QUICK_ARGS = ("t5", "ernie4_5_moe", "--dtype", "bf16")
"""Two zoo models, one dtype: a smoke run of the benchmark, not its figure."""
RUN_TIMEOUT = 3600.0

PROBE = """
import json, pathlib, sys
import fp32keep, pytest_fp32keep.check.cli, pytest_fp32keep.check.ranks
ours = ("fp32keep", "pytest_fp32keep")
print(json.dumps({
    "modules": {
        name: getattr(module, "__file__", None) or ""
        for name, module in sorted(sys.modules.items())
        if name.split(".")[0] in ours
    },
    "observe": any(
        (pathlib.Path(fp32keep.__file__).parent / where).is_file()
        for where in ("observe.py", "uses/observe.py")
    ),
}))
"""
"""What each arm imports, in the environment and directory its command and ranks get: every
module of both packages that the command and the ranks' program load, and whether the tree has
the observation module (``fp32keep/observe.py`` as issue 22 added it, ``fp32keep/uses/observe.py``
since). ``importlib.util.find_spec`` would not do for the
latter: the venv's editable finder answers a submodule the old tree lacks from this tree."""


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: a source tree and the environment that imports from it."""

    name: str
    tree: Path
    revision: str
    env: Mapping[str, str]


def resolve_revision(revision: str) -> str:
    """The full commit hash of ``revision`` in this repository (read-only)."""
    done = subprocess.run(
        ["git", "rev-parse", "--verify", f"{revision}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench_check: unknown revision {revision!r}: {done.stderr.strip()}")
    return done.stdout.strip()


def materialise(commit: str) -> Path:
    """``git archive COMMIT`` extracted into ``bench/out/check-<short>/``, reused when its stamp
    names the same commit (a half-extracted folder has no stamp and is extracted again)."""
    folder = OUT_DIR / f"check-{commit[:12]}"
    stamp = folder / ".bench-commit"
    if stamp.is_file() and stamp.read_text().strip() == commit:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    stamp.write_text(commit + "\n")
    return folder


def arm_env(tree: Path) -> dict[str, str]:
    """The environment of one arm: ``PYTHONPATH`` is the tree and its ``impl/`` only.

    ``python_env`` would put this repository's root first, which would shadow the old tree's
    ``pytest_fp32keep``; a caller's own ``PYTHONPATH`` is dropped for the same reason.
    """
    env = python_env()
    env["PYTHONPATH"] = f"{tree}:{tree / 'impl'}"
    return env


def verify(arm: Arm, expect_observe: bool | None) -> dict[str, Any]:
    """Run :data:`PROBE` as the arm's command and ranks would import, and check the answers."""
    # The command prepends its current directory (the tree) to the ranks' PYTHONPATH: the same.
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=arm.tree,
        env=dict(arm.env),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"probe of the {arm.name} arm failed:\n{done.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    strays = {
        name: file
        for name, file in found["modules"].items()
        if not file or not Path(file).resolve().is_relative_to(arm.tree.resolve())
    }
    if strays or "pytest_fp32keep.check.ranks" not in found["modules"]:
        raise RuntimeError(f"the {arm.name} arm imports modules from outside {arm.tree}: {strays}")
    if expect_observe is not None and found["observe"] is not expect_observe:
        raise RuntimeError(
            f"the {arm.name} arm {'lacks' if expect_observe else 'has'} fp32keep/uses/observe.py: "
            f"{arm.tree} is not the code this arm should measure"
        )
    return found


def run_arm(arm: Arm, check_args: Sequence[str], report: Path) -> tuple[float, dict[str, Any]]:
    """One timed ``fp32keep check``: wall seconds and the report it wrote."""
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest_fp32keep.check.cli", "check", *check_args]
    command += ["--report-json", str(report)]
    completed = run_timed(command, timeout=RUN_TIMEOUT, env=arm.env, cwd=arm.tree, check=False)
    if completed.returncode not in (0, 1) or not report.is_file():  # 1: a case failed: a row
        raise RuntimeError(
            f"{arm.name} arm: {shlex.join(command)} exited {completed.returncode}:\n"
            f"{completed.output[-6000:]}"
        )
    return completed.seconds, read_json(report)


def outcomes(report: Mapping[str, Any]) -> dict[str, str]:
    """``target dtype context`` -> ``pass`` / the outcome, for comparing the arms' work."""
    return {
        f"{case['target']} {case['dtype']} {case['context']}": (
            "pass" if case["ok"] else str(case.get("outcome", "fail"))
        )
        for case in report["cases"]
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="two zoo models at bf16, 2 rounds")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds (default {FULL_ROUNDS}, quick {QUICK_ROUNDS})",
    )
    parser.add_argument(
        "--old", default=OLD_REVISION, help=f"the old arm's revision ({OLD_REVISION})"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else QUICK_ROUNDS if args.quick else FULL_ROUNDS
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    check_args = list(QUICK_ARGS) if args.quick else []
    check_args += ["--nproc", "2"]
    started = time.perf_counter()
    old_commit = resolve_revision(args.old)
    old_tree = materialise(old_commit)
    arms = {
        "new": Arm("new", ROOT, "this tree", arm_env(ROOT)),
        "old": Arm("old", old_tree, old_commit[:7], arm_env(old_tree)),
    }
    imports = {
        "new": verify(arms["new"], expect_observe=True),
        # only the issue-22 revision is known to lack the observation; any other --old is not
        # checked for it (its imports are still checked to come from its own tree)
        "old": verify(
            arms["old"], expect_observe=False if old_commit.startswith(OLD_REVISION) else None
        ),
    }
    load_before = load_average()
    seconds: dict[str, list[float]] = {"new": [], "old": []}
    ranks: dict[str, list[float]] = {"new": [], "old": []}
    ratios: list[float] = []
    seen: dict[str, dict[str, str]] = {}
    for index in range(rounds):
        order = ("new", "old") if index % 2 == 0 else ("old", "new")
        this_round: dict[str, float] = {}
        for name in order:
            wall, report = run_arm(arms[name], check_args, OUT_DIR / f"check-{name}.json")
            seconds[name].append(wall)
            ranks[name].append(float(report["seconds"]))
            this_round[name] = wall
            seen.setdefault(name, outcomes(report))
            print(
                f"round {index + 1}/{rounds} {name}: {wall:.1f} s "
                f"(ranks {report['seconds']} s, {len(report['cases'])} cases)",
                flush=True,
            )
        ratios.append(this_round["new"] / this_round["old"])

    shown = "fp32keep check " + " ".join(check_args)
    result = BenchResult(
        name="check",
        title="fp32keep check on the zoo: this tree against "
        + ("the code before issue 22" if args.old == OLD_REVISION else old_commit[:7]),
        command=" ".join(
            ["python bench/bench_check.py"]
            + (["--quick"] if args.quick else [])
            + ([f"--rounds {rounds}"] if args.rounds is not None else [])
            + ([f"--old {args.old}"] if args.old != OLD_REVISION else [])
        ),
        mode="quick" if args.quick else "full",
        load_before=load_before,
    )
    table = Table(
        f"`{shown}`, {rounds} rounds in alternating order (new = this tree, old = "
        f"{old_commit[:7]} via `git archive`); wall time from spawn to exit, seconds",
        ["arm", "median wall", "min–max", "ranks' share (median)", "parent (median)", "cases"],
    )
    for name in ("new", "old"):
        parent = [wall - inner for wall, inner in zip(seconds[name], ranks[name], strict=True)]
        table.rows.append(
            [
                f"{name} ({arms[name].revision})",
                fmt(median(seconds[name])),
                spread(seconds[name]),
                fmt(median(ranks[name])),
                fmt(median(parent)),
                str(len(seen[name])),
            ]
        )
    table.rows.append(
        ["ratio new / old (median of rounds)", fmt(median(ratios)), spread(ratios), "", "", ""]
    )
    result.tables.append(table)
    ratio = median(ratios)
    result.targets.append(
        Target(
            "fp32keep check on the zoo, new / old wall time",
            f"{ratio:.3f}x",
            None if args.quick else ratio <= TARGET_RATIO,
            f"<= {TARGET_RATIO:.2f}x",
        )
    )
    differ = sorted(
        case
        for case in set(seen["new"]) | set(seen["old"])
        if seen["new"].get(case) != seen["old"].get(case)
    )
    if differ:
        result.notes.append(
            "the arms' outcomes differ: "
            + "; ".join(
                f"{case}: new {seen['new'].get(case, 'absent')}, "
                f"old {seen['old'].get(case, 'absent')}"
                for case in differ
            )
        )
    else:
        result.notes.append(
            f"both arms ran the same {len(seen['new'])} cases with the same outcomes"
        )
    result.notes.append(
        "imports verified before timing: every fp32keep and pytest_fp32keep module the command "
        f"and its ranks load ({len(imports['new']['modules'])} new, "
        f"{len(imports['old']['modules'])} old) comes from the arm's own tree (new {ROOT}, "
        f"old {old_tree})"
        + (
            "; the old tree has no fp32keep observation module, this tree has it"
            if old_commit.startswith(OLD_REVISION)
            else ""
        )
    )
    if args.quick:
        result.notes.append(
            "quick mode: two models at bf16, two rounds; the target needs the full run "
            "(`python bench/bench_check.py`: the whole zoo, bf16 and fp16, five rounds)"
        )
    finish(result, args.json, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
