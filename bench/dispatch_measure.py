"""Cost of one marked 2-rank test: ranks kept alive vs. one torchrun per test, side by side.

    python bench/dispatch_measure.py                      # 40 warm tests, 30 per baseline
    python bench/dispatch_measure.py --tests 60 --baseline-tests 10 --baselines script

What is measured, all on the same tiny test body (a 1-element ``all_reduce`` over 2 gloo ranks):

- ``kept-alive``: the plugin's normal path. ``N`` marked tests in one pytest session; per test
  the wall time in the pytest process from ``pytest_runtest_logstart`` to the next test's
  (the full cost of a test in the loop: dispatch, the ranks' pytest protocol, the merge, the
  report). The first ``--warmup`` tests (the first one starts the ranks) are left out.
- ``script`` baseline: one ``torchrun --standalone --nproc-per-node=2`` per test running a
  plain script (init the process group, the same ``all_reduce``, destroy): the cheapest form
  of "one torchrun per test", without pytest in the ranks.
- ``isolated`` baseline: the same marked tests with ``isolated=True`` (one torchrun and one
  pytest session in the ranks per test), which is how harnesses that re-run pytest per test
  behave.

Results are printed and written as JSON to ``bench/out/dispatch_measure.json``. Medians are
reported because the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

TIMING_CONFTEST = """
import json, os, time
from pathlib import Path

import pytest

# One mark per event: [kind, nodeid, wall (perf_counter), this process's CPU (process_time)].
# The user's pytest process writes marks.json; each rank of the plugin (torchrun sets RANK)
# writes marks-rank<RANK>.json, so per-test CPU time is known for the parent and every rank.
# Where the test function runs (a rank, or a plain pytest session), "body" and "body-end" mark
# its call, so the time a process spends outside it can be split around it.
_marks = []
_rank = os.environ.get("RANK")


def pytest_runtest_logstart(nodeid, location):
    _marks.append(["start", nodeid, time.perf_counter(), time.process_time()])


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    _marks.append(["body", pyfuncitem.nodeid, time.perf_counter(), time.process_time()])
    try:
        return (yield)
    finally:
        _marks.append(["body-end", pyfuncitem.nodeid, time.perf_counter(), time.process_time()])


def pytest_runtest_logfinish(nodeid, location):
    _marks.append(["finish", nodeid, time.perf_counter(), time.process_time()])


def pytest_unconfigure(config):
    _marks.append(["end", "", time.perf_counter(), time.process_time()])
    name = "marks.json" if _rank is None else f"marks-rank{_rank}.json"
    (Path(__file__).parent / name).write_text(json.dumps(_marks))
"""

MARKED_TESTS = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.fsdp2(nproc=2, backend="gloo", isolated={isolated})
@pytest.mark.parametrize("i", range({count}))
def test_tiny_all_reduce(i):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
"""

PLAIN_SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
assert value.item() == 2
dist.destroy_process_group()
"""


def _summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {
        "count": len(values),
        "median_s": statistics.median(values),
        "p10_s": ordered[len(ordered) // 10],
        "p90_s": ordered[(len(ordered) * 9) // 10],
        "min_s": ordered[0],
        "max_s": ordered[-1],
    }


def measure_plugin(workdir: Path, count: int, warmup: int, isolated: bool) -> dict[str, Any]:
    """Run ``count`` marked tests in one pytest session and time each in the pytest process."""
    project = workdir / ("isolated" if isolated else "kept_alive")
    project.mkdir()
    (project / "conftest.py").write_text(TIMING_CONFTEST)
    (project / "test_tiny.py").write_text(MARKED_TESTS.format(count=count, isolated=isolated))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    session_s = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"inner pytest failed:\n{completed.stdout}\n{completed.stderr}")
    marks = json.loads((project / "marks.json").read_text())
    starts = [t for kind, _, t, _ in marks if kind == "start"]
    finishes = [t for kind, _, t, _ in marks if kind == "finish"]
    # Per test: from its logstart to the next test's logstart (or its own logfinish for the
    # last): everything the loop spends on one test, reporting included.
    per_test = [b - a for a, b in zip(starts, [*starts[1:], finishes[-1]], strict=True)]
    inside = [f - s for s, f in zip(starts, finishes, strict=True)]
    return {
        "session_s": session_s,
        "first_test_s": per_test[0],
        "per_test": _summary(per_test[warmup:]),
        "logstart_to_logfinish": _summary(inside[warmup:]),
    }


def measure_script(workdir: Path, count: int) -> dict[str, Any]:
    """One torchrun per test, each running a plain script with the same all_reduce."""
    script = workdir / "tiny_all_reduce.py"
    script.write_text(PLAIN_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        str(script),
    ]
    times: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run(command, cwd=workdir, capture_output=True, check=True, timeout=600)
        times.append(time.perf_counter() - started)
    return {"per_test": _summary(times)}


def main() -> None:
    """Measure, print a summary, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=40, help="marked tests, kept-alive ranks")
    parser.add_argument("--warmup", type=int, default=3, help="first tests left out")
    parser.add_argument("--baseline-tests", type=int, default=30, help="tests per baseline")
    parser.add_argument(
        "--baselines",
        default="script,isolated",
        help="comma-separated: script (plain torchrun per test), isolated (pytest per test)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args()
    baselines = [b for b in args.baselines.split(",") if b]

    results: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="dispatch-measure-") as tmp:
        workdir = Path(tmp)
        results["kept_alive"] = measure_plugin(workdir, args.tests, args.warmup, isolated=False)
        if "script" in baselines:
            results["torchrun_script_per_test"] = measure_script(workdir, args.baseline_tests)
        if "isolated" in baselines:
            results["torchrun_pytest_per_test"] = measure_plugin(
                workdir, args.baseline_tests, 0, isolated=True
            )

    warm = results["kept_alive"]["per_test"]["median_s"]
    lines = [
        f"kept-alive ranks: median {warm * 1000:.1f} ms per test "
        f"(p90 {results['kept_alive']['per_test']['p90_s'] * 1000:.1f} ms, "
        f"{results['kept_alive']['per_test']['count']} tests after {args.warmup} warm-up; "
        f"first test incl. start {results['kept_alive']['first_test_s']:.1f} s)"
    ]
    for key, label in (
        ("torchrun_script_per_test", "torchrun + plain script per test"),
        ("torchrun_pytest_per_test", "torchrun + pytest per test (isolated=True)"),
    ):
        if key in results:
            median = results[key]["per_test"]["median_s"]
            results[key]["ratio_to_kept_alive"] = median / warm
            lines.append(
                f"{label}: median {median:.2f} s per test "
                f"({results[key]['per_test']['count']} tests) -> {median / warm:.0f}x"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dispatch_measure.json").write_text(json.dumps(results, indent=2))
    print(textwrap.indent("\n".join(lines), "  "))
    print(f"  details: {args.out / 'dispatch_measure.json'}")


if __name__ == "__main__":
    main()
