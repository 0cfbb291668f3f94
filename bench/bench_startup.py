"""Start-up cost of the plugin: ``pytest --collect-only -q`` with and without it.

    python bench/bench_startup.py [--quick] [--json OUT]

A generated project of 200 ordinary tests (20 files of 10, each file importing only the standard
library, an empty ``pytest.ini`` so the repository's configuration is not picked up) is collected
with the plugin (pytest's default: every ``pytest11`` entry point loads) and with ``-p
no:fp32keep`` (the plugin's entry point name), in alternating order, many times. Each run is a
fresh interpreter, timed from spawn to exit, because that is what a user waits for. The table
gives medians, their difference, and what the plugin makes Python import (``python -X
importtime``: the modules only the default arm imports, and their self time).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _common import (
    BenchResult,
    Table,
    Target,
    finish,
    fmt,
    load_average,
    median,
    python_env,
    run_timed,
    spread,
)

PLUGIN_NAME = "fp32keep"
"""The ``pytest11`` entry point name: ``-p no:fp32keep`` blocks it."""
PLUGIN_MODULE = "pytest_fp32keep.plugin"
FILES = 20
TESTS_PER_FILE = 10


def write_project(root: Path) -> None:
    """200 plain tests that collect the same with or without the plugin."""
    (root / "pytest.ini").write_text("[pytest]\n")
    for index in range(FILES):
        body = [f'"""Generated file {index}: ordinary tests, no markers."""', ""]
        for test in range(TESTS_PER_FILE):
            body += [f"def test_case_{index}_{test}():", f"    assert {test} + {index} >= 0", ""]
        (root / f"test_generated_{index:02d}.py").write_text("\n".join(body))


def collect(root: Path, *extra: str) -> float:
    """Seconds for one ``pytest --collect-only -q`` in a fresh interpreter; checks the count."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", *extra]
    completed = run_timed(command, timeout=300, cwd=root, env=python_env())
    expected = FILES * TESTS_PER_FILE
    if f"{expected} tests collected" not in completed.output:
        raise RuntimeError(f"expected {expected} tests collected, got:\n{completed.output[-3000:]}")
    return completed.seconds


def plugin_loaded(root: Path) -> bool:
    """Whether a default run registers the plugin (``--trace-config`` lists active plugins)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "--trace-config"]
    output = run_timed(command, timeout=300, cwd=root, env=python_env()).output
    return PLUGIN_MODULE in output or f"{PLUGIN_NAME}:" in output


def _import_self_us(root: Path, *extra: str) -> dict[str, int]:
    """Self import time (us) of every module a collect-only run imports, by module name."""
    command = [sys.executable, "-X", "importtime", "-m", "pytest", "--collect-only", "-q", *extra]
    output = run_timed(command, timeout=300, cwd=root, env=python_env()).output
    found: dict[str, int] = {}
    for line in output.splitlines():
        match = re.match(r"import time:\s+(\d+)\s+\|\s+\d+\s+\|\s*(\S+)\s*$", line)
        if match:
            found[match.group(2)] = int(match.group(1))
    return found


def plugin_imports(root: Path) -> tuple[float, list[tuple[str, float]]]:
    """Modules that only the default arm imports: their summed self time (ms) and the top five.

    This is what the plugin costs at import, measured inside the very command the table times
    (``python -X importtime``, one run per arm, so it is as noisy as one run).
    """
    with_plugin = _import_self_us(root)
    without = _import_self_us(root, "-p", f"no:{PLUGIN_NAME}")
    extra = {name: us / 1000 for name, us in with_plugin.items() if name not in without}
    top = sorted(extra.items(), key=lambda item: -item[1])[:5]
    return sum(extra.values()), top


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="few repeats")
    parser.add_argument("--json", type=Path, help="write the result here as JSON")
    parser.add_argument("--repeats", type=int, help="runs per arm")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    repeats = args.repeats or (4 if args.quick else 40)
    result = BenchResult(
        name="startup",
        title="Plugin start-up: pytest --collect-only -q on 200 tests",
        command="python bench/bench_startup.py" + (" --quick" if args.quick else ""),
        mode="quick" if args.quick else "full",
        load_before=load_average(),
    )
    with tempfile.TemporaryDirectory(prefix="fp32keep-startup-") as folder:
        root = Path(folder)
        write_project(root)
        loaded = plugin_loaded(root)
        collect(root)  # warm the OS file cache for both arms alike
        collect(root, "-p", f"no:{PLUGIN_NAME}")
        with_plugin: list[float] = []
        without: list[float] = []
        for index in range(repeats):
            # Alternate which arm goes first, so drift in machine load hits both alike.
            if index % 2 == 0:
                with_plugin.append(collect(root))
                without.append(collect(root, "-p", f"no:{PLUGIN_NAME}"))
            else:
                without.append(collect(root, "-p", f"no:{PLUGIN_NAME}"))
                with_plugin.append(collect(root))
        importing, top_imports = plugin_imports(root)
    base = median(without)
    paired = median([a - b for a, b in zip(with_plugin, without, strict=True)])
    table = Table(
        f"{repeats} runs per arm, alternating; each a fresh interpreter. Plugin loaded in the "
        f"default arm: {'yes' if loaded else 'NO (entry point not registered?)'}.",
        ["arm", "median ms", "min–max ms", "added ms", "added %"],
    )
    table.rows.append(
        ["-p no:fp32keep", fmt(base * 1e3), spread([s * 1e3 for s in without]), "", ""]
    )
    table.rows.append(
        [
            "default (plugin loaded)",
            fmt(median(with_plugin) * 1e3),
            spread([s * 1e3 for s in with_plugin]),
            fmt(paired * 1e3),
            fmt(paired / base * 100),
        ]
    )
    result.tables.append(table)
    result.targets.append(
        Target(
            "added time", f"{paired * 1e3:.1f} ms", paired <= 0.020 if loaded else None, "<= 20 ms"
        )
    )
    result.targets.append(
        Target(
            "added share",
            f"{paired / base * 100:.1f} %",
            paired / base < 0.05 if loaded else None,
            "< 5 %",
        )
    )
    result.notes.append(
        "added = median over pairs of (default - no:fp32keep), each pair run back to back."
    )
    listed = ", ".join(f"{name} {ms:.1f}" for name, ms in top_imports) or "none"
    result.notes.append(
        f"Modules imported only with the plugin (`python -X importtime`, one run per arm): "
        f"{fmt(importing)} ms of self time in all; largest (ms): {listed}."
    )
    finish(result, args.json, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
