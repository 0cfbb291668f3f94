"""Shared plumbing for the benchmarks: statistics, memory probes, launching, result files.

Every ``bench_*.py`` script is a parent that launches the measured work in fresh processes
(``torchrun`` or a plain subprocess), collects what those processes wrote as JSON, and ends with
a :class:`BenchResult`: markdown tables plus the targets it checked. ``run_all.py`` merges the
results into ``bench/RESULTS.md``. Nothing here imports torch, so a parent that only launches
and formats stays cheap.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (``bench/`` lives directly below it)."""

BENCH_DIR = ROOT / "bench"
OUT_DIR = BENCH_DIR / "out"
"""Scratch results (git-ignored): one JSON per benchmark run."""


# ----------------------------------------------------------------------------------------------
# statistics


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values (a missing arm shows as ``n/a`` instead of crashing)."""
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """``min–max`` of the values, to show how noisy a median is."""
    if not values:
        return "n/a"
    return f"{fmt(min(values))}–{fmt(max(values))}"


def fmt(value: float | None) -> str:
    """A number with about three significant figures; ``n/a`` for None or NaN."""
    if value is None or value != value:  # NaN is the only value unequal to itself
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


# ----------------------------------------------------------------------------------------------
# memory (Linux /proc)


def proc_status_kib(field_name: str) -> int:
    """One ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``); -1 where unavailable."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return -1
    found = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else -1


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` (peak resident set) to the current RSS.

    Writing ``5`` to ``/proc/self/clear_refs`` does exactly that (Linux 4.0+). It lets a process
    measure the peak of one phase after set-up phases with higher transient peaks. Returns False
    where the kernel refuses, in which case peaks include everything since the process started.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# machine facts


def load_average() -> str:
    """``uptime``'s load averages (1, 5, 15 min), the figure that says how noisy a run was."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def machine_summary() -> dict[str, str]:
    """Cores, memory, CPU model and load: the facts RESULTS.md needs to be read correctly."""
    facts: dict[str, str] = {"cores": str(os.cpu_count() or "n/a"), "load": load_average()}
    try:
        meminfo = Path("/proc/meminfo").read_text()
        total = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.MULTILINE)
        if total:
            facts["memory"] = f"{int(total.group(1)) / 2**20:.1f} GiB"
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
        if model:
            facts["cpu"] = model.group(1).strip()
    except OSError:
        pass
    return facts


# ----------------------------------------------------------------------------------------------
# launching


def python_env(extra: Mapping[str, str] | None = None, paths: Sequence[str] = ()) -> dict[str, str]:
    """The environment for a child Python: the repo root importable, pytest's defaults restored.

    ``PYTHONPATH`` gets the root first so ``bench`` helpers and the editable packages resolve the
    same way in every child; ``OMP_NUM_THREADS`` is left to the launcher (torchrun sets 1 per
    rank when it starts several); ``paths`` are appended to ``PYTHONPATH``.
    """
    env = dict(os.environ)
    # A user's installed package has its bytecode cached (pip compiles it; an editable install
    # writes it on first import): a machine-wide PYTHONDONTWRITEBYTECODE would time compiling
    # every module of the plugin on every run instead (57 ms of start-up on this machine).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # A caller's pytest settings must not leak into the generated projects' runs.
    for name in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(name, None)
    search = [str(ROOT), str(BENCH_DIR)]
    if env.get("PYTHONPATH"):
        search.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join([*search, *paths])
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def torchrun_command(nproc: int, script: Path | str, *args: str, module: bool = False) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N script args``.

    ``--standalone`` picks a free port through a local rendezvous (no guessed ports), and going
    through ``python -m`` keeps the child on the same interpreter as the parent. With ``module``
    each rank runs ``script`` as a module (torchrun's ``--module``: ``python -m script``).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *(["--module"] if module else []),
        str(script),
        *args,
    ]


@dataclass(frozen=True)
class Completed:
    """A finished child: how long it took end to end and what it printed."""

    seconds: float
    returncode: int
    output: str


def run_timed(
    command: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
) -> Completed:
    """Run ``command`` to completion and time it with a monotonic clock.

    Raises ``RuntimeError`` with the command's last output when it fails and ``check`` is set:
    a benchmark arm that crashed must never show up as a fast one.
    """
    start = time.perf_counter()
    completed = subprocess.run(
        list(command),
        cwd=cwd or ROOT,
        env=dict(env) if env is not None else python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    seconds = time.perf_counter() - start
    if check and completed.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(command)} exited {completed.returncode} after {seconds:.1f} s:\n"
            f"{completed.stdout[-6000:]}"
        )
    return Completed(seconds, completed.returncode, completed.stdout)


def read_json(path: Path) -> Any:
    """Parse a JSON file a child wrote."""
    return json.loads(path.read_text())


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


# ----------------------------------------------------------------------------------------------
# results


@dataclass
class Table:
    """A markdown table: a caption line, a header and rows of already formatted cells."""

    caption: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def markdown(self) -> str:
        """The table as GitHub markdown, caption first."""
        lines = [self.caption, "", "| " + " | ".join(self.header) + " |"]
        lines.append("|" + "|".join(" --- " for _ in self.header) + "|")
        lines.extend("| " + " | ".join(row) + " |" for row in self.rows)
        return "\n".join(lines)


@dataclass
class Target:
    """One target from the issue and whether this run met it.

    ``met`` is None when the run could not decide (an arm was unavailable): that is reported as
    "not measured", never as met.
    """

    name: str
    measured: str
    met: bool | None
    limit: str = ""

    @property
    def verdict(self) -> str:
        """``met``, ``MISSED`` or ``not measured``."""
        return {True: "met", False: "MISSED", None: "not measured"}[self.met]


@dataclass
class BenchResult:
    """Everything one benchmark reports: what ran, its tables, targets and notes."""

    name: str
    title: str
    command: str
    mode: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_before: str = ""
    load_after: str = ""
    seconds: float = 0.0

    def markdown(self) -> str:
        """The section RESULTS.md shows for this benchmark."""
        parts = [
            f"## {self.title}",
            "",
            f"Command: `{self.command}` ({self.mode} mode, {self.seconds:.0f} s; load average "
            f"before {self.load_before}, after {self.load_after}).",
        ]
        for table in self.tables:
            parts += ["", table.markdown()]
        if self.targets:
            targets = Table("Targets:", ["target", "measured", "limit", "verdict"])
            for target in self.targets:
                targets.rows.append([target.name, target.measured, target.limit, target.verdict])
            parts += ["", targets.markdown()]
        if self.notes:
            parts += [""] + [f"- {note}" for note in self.notes]
        return "\n".join(parts) + "\n"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``run_all.py`` reads it back with :meth:`from_json`)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchResult:
        """Rebuild a result that :meth:`to_json` wrote."""
        fields = dict(data)
        fields["tables"] = [Table(**table) for table in data.get("tables", [])]
        fields["targets"] = [Target(**target) for target in data.get("targets", [])]
        return cls(**fields)


def finish(result: BenchResult, json_path: Path | None, started: float) -> None:
    """Stamp the duration and load, print the section, and write it as JSON when asked."""
    result.seconds = time.perf_counter() - started
    result.load_after = load_average()
    print(result.markdown(), flush=True)
    if json_path is not None:
        write_json(json_path, result.to_json())
