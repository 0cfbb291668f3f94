"""How long ``fp32keep check --all-families`` takes: every family whose model keeps a tensor.

    python bench/bench_families.py [--quick] [--json OUT] [--transformers 5.24.0]

Issue 13's figure: ``fp32keep check --all-families --dtype bf16,fp16 --nproc 2`` on Transformers
5.24.0, target at most 15 minutes on 2 cores (the ranks stay up across every case). That version
is installed once with ``pip install --target build/bench/transformers-X 'transformers==X'`` (with
the ``[families]`` ``extra_requirements`` of ci/matrix.toml) and
put first on the command's ``PYTHONPATH`` (the ranks inherit it), so the benchmark does not
change the venv it runs from. The command is timed from spawn to exit, as a user waits for it;
its JSON report gives the part the ranks spent on the cases (``seconds``), so the rest is the
parent's probe (import, build, batch, one unsharded step per family) and the start-up. ``--quick``
checks three families at bf16 only.
"""

from __future__ import annotations

import argparse
import collections
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from _common import (
    ROOT,
    BenchResult,
    Table,
    Target,
    finish,
    load_average,
    python_env,
    read_json,
    run_timed,
)

TARGET_SECONDS = 15 * 60
"""Issue 13: the whole command within 15 minutes on 2 cores."""
QUICK_FAMILIES = ("t5", "ernie4_5_moe", "gpt_oss")


EXTRA_REQUIREMENTS: list[str] = tomllib.loads((ROOT / "ci" / "matrix.toml").read_text())[
    "families"
]["extra_requirements"]
"""What ``nox -s families`` installs beside Transformers (scipy for Inkling), so that the same
families build here as in docs/families.md."""


def install_transformers(version: str) -> Path:
    """``transformers==version``, :data:`EXTRA_REQUIREMENTS` and what they need in a folder of
    their own; reused when the folder holds exactly these requirements."""
    folder = ROOT / "build" / "bench" / f"transformers-{version}"
    requirements = [f"transformers=={version}", *EXTRA_REQUIREMENTS]
    stamp = folder / "bench-requirements.txt"
    if not stamp.is_file() or stamp.read_text().split() != requirements:
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--upgrade"),
                *("--target", str(folder), *requirements),
            ],
            check=True,
        )
        stamp.write_text("\n".join(requirements) + "\n")
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="three families, bf16 only")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--transformers", default="5.24.0", help="the Transformers to check")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    folder = install_transformers(args.transformers)
    report = ROOT / "bench" / "out" / f"families-{args.transformers}.json"
    report.unlink(missing_ok=True)
    dtypes = "bf16" if args.quick else "bf16,fp16"
    which = [f"--family={name}" for name in QUICK_FAMILIES] if args.quick else ["--all-families"]
    command = [sys.executable, "-m", "pytest_fp32keep.check.cli", "check", *which]
    command += ["--dtype", dtypes, "--nproc", "2", "--report-json", str(report)]
    load_before = load_average()
    # PYTHONPATH comes before the venv's site-packages, so the folder's Transformers wins, in the
    # ranks too (they inherit the environment).
    env = python_env(paths=[str(folder)])
    completed = run_timed(command, timeout=3 * TARGET_SECONDS, env=env, check=False)
    if completed.returncode not in (0, 1):  # 1: some family failed, a row of the table
        raise RuntimeError(f"exit {completed.returncode}:\n{completed.output[-6000:]}")
    data = read_json(report)
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    outcomes = collections.Counter(
        (case["dtype"], "pass" if case["ok"] else case["outcome"]) for case in data["cases"]
    )
    installed = data.get("versions", {}).get("transformers", "?")
    shown = "fp32keep check " + " ".join(which) + f" --dtype {dtypes} --nproc 2"
    result = BenchResult(
        name="families",
        title="Families: `fp32keep check --all-families`, 2 ranks (gloo, CPU)",
        command=f"python bench/bench_families.py{' --quick' if args.quick else ''}",
        mode="quick" if args.quick else "full",
        load_before=load_before,
    )
    families = len({case["target"] for case in data["cases"]}) + len(data.get("unavailable", {}))
    table = Table(
        f"`{shown}` with Transformers {installed} (`PYTHONPATH={folder.relative_to(ROOT)}`)",
        ["figure", "measured"],
    )
    parent = completed.seconds - data["seconds"]
    unavailable = len(data.get("unavailable", {}))
    table.rows += [
        ["wall time, whole command", f"{completed.seconds:.0f} s"],
        ["of which the ranks, every case (the report's `seconds`)", f"{data['seconds']:.0f} s"],
        ["of which the parent: probe of every family, start-up", f"{parent:.0f} s"],
        ["families checked / of which not buildable", f"{families} / {unavailable}"],
        ["cases run (buildable families x dtypes)", str(len(data["cases"]))],
        ["largest process's peak RSS", f"{peak_mib:.0f} MiB"],
    ]
    for dtype in dtypes.split(","):
        counts = {kind: n for (d, kind), n in outcomes.items() if d == dtype}
        table.rows.append(
            [f"{dtype} outcomes", ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))]
        )
    result.tables.append(table)
    result.targets.append(
        Target(
            f"wall time, --all-families on {installed}, both dtypes, 2 ranks",
            f"{completed.seconds / 60:.1f} min",
            None if args.quick else completed.seconds <= TARGET_SECONDS,
            "<= 15 min",
        )
    )
    result.notes.append(
        "docs/families.md has every family's outcome (`nox -s families`); this section times the "
        "command only."
    )
    finish(result, args.json, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
