"""docs/frameworks.md is the rendering of a real run, and tests/frameworks stays out of ``pytest``.

Cheap (no torch, no rank): the committed page equals ``ci/frameworks_report.py``'s rendering of
the committed ``docs/frameworks.json``; the renderer shows crashes, passing cases and failing rows,
and refuses malformed records naming the file; and ``tests/frameworks`` is collected only with
``--slow`` where the pinned framework versions are installed (elsewhere the run says so; collected,
a missing framework fails, never skips).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ci import frameworks_report
from tests.frameworks import conftest as frameworks_conftest

ROOT = Path(__file__).resolve().parents[1]


def _record(setup: str, model: str, rows: list[str], crash: str | None = None) -> dict[str, Any]:
    return {
        "setup": setup,
        "framework": "accelerate",
        "description": "how it was configured",
        "versions": {"accelerate": "1.15.0", "torch": "2.13.0", "transformers": "5.24.0"},
        "model": model,
        "dtype": "bf16",
        "rows": rows,
        "crash": crash,
        "kept": 2,
        "examples": [f"{row}: x: expected a|b, observed c" for row in rows if not crash],
        "notes": [],
        "why": f"why {setup} {model}",
    }


def test_committed_page_is_the_rendering_of_its_data() -> None:
    data = frameworks_report.load_data(ROOT / frameworks_report.DATA_PATH)
    page = (ROOT / frameworks_report.TABLE_PATH).read_text(encoding="utf-8")
    assert page == frameworks_report.render_markdown(data), (
        "docs/frameworks.md is stale or hand-edited: run nox -s frameworks"
    )
    # The negative control: one changed cell is a different page.
    data["records"][0]["rows"] = ["stored (kept)"]
    assert page != frameworks_report.render_markdown(data)


def test_render_shows_rows_crashes_and_passes(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    cases = [
        _record("b", "t5", ["materialized (kept)", "round trip (not kept)"]),
        _record("a", "t5", ["crash: ValueError"], crash="ValueError: tied (at f, x.py:1)"),
        _record("a", "llama", []),
    ]
    for index, case in enumerate(cases):
        (results / f"{index}.json").write_text(json.dumps(case), encoding="utf-8")
    when = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)
    text = frameworks_report.render(
        results, tmp_path / "d.json", tmp_path / "p.md", nproc=2, now=when
    )
    assert text == (tmp_path / "p.md").read_text(encoding="utf-8")
    table = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[2] for line in table] == ["`llama`", "`t5`", "`t5`"]  # sorted
    assert table[0].endswith("| 2 | none: the contract holds |")
    assert table[1].endswith("| - | **crash** `ValueError` |")
    assert "`materialized (kept)`, `round trip (not kept)` |" in table[2]
    assert "accelerate 1.15.0 (torch 2.13.0, transformers 5.24.0)" in table[2]
    assert "  - ValueError: tied (at f, x.py:1)" in text
    assert "  - why: why b t5" in text
    assert "expected a\\|b, observed c" in text  # a pipe cannot split a Markdown cell
    assert "Run 2026-01-02" in text


def test_malformed_records_are_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(frameworks_report.ReportError, match="no such folder"):
        frameworks_report.read_records(tmp_path / "missing")
    with pytest.raises(frameworks_report.ReportError, match="no records"):
        frameworks_report.read_records(tmp_path)
    broken = _record("a", "t5", [])
    del broken["rows"]
    (tmp_path / "broken.json").write_text(json.dumps(broken), encoding="utf-8")
    with pytest.raises(
        frameworks_report.ReportError, match=r"broken\.json: record lacks \['rows'\]"
    ):
        frameworks_report.read_records(tmp_path)


def _collect_frameworks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(
    not frameworks_conftest.missing_versions(), reason="the pinned framework versions are here"
)
def test_without_the_pinned_versions_the_slow_tier_leaves_them_out_and_says_so() -> None:
    """The README's environment (Transformers 5.10): neither ``pytest`` nor ``pytest --slow``
    collects tests/frameworks; ``--slow`` says which versions it lacks and where they run."""
    default = _collect_frameworks("tests/frameworks")
    assert default.returncode == 5, default.stdout + default.stderr  # pytest: no tests collected
    assert "tests/frameworks not collected" not in default.stdout  # no --slow: nothing to say
    slow = _collect_frameworks("--slow", "tests/frameworks")
    assert slow.returncode == 5, slow.stdout + slow.stderr
    lacking = frameworks_conftest.missing_versions()
    assert f"tests/frameworks not collected: it needs {lacking}" in slow.stdout
    assert "nox -s frameworks" in slow.stdout


def test_only_the_pinned_versions_collect_them() -> None:
    """Which installed versions satisfy ``[frameworks]`` (a line pin or an exact one); every lack
    is named with what is installed. Collected, nothing skips (no ``importorskip``)."""
    pins = {"transformers": "5.24", "accelerate": "1.15.0"}
    missing = frameworks_conftest.missing
    assert missing(pins, {"transformers": "5.24.0", "accelerate": "1.15.0"}) == ""
    assert missing(pins, {"transformers": "5.24.3", "accelerate": "1.15.0"}) == ""
    assert missing(pins, {"transformers": "5.10.4", "accelerate": "1.15.0"}) == (
        "transformers 5.24 (5.10.4)"
    )
    assert missing(pins, {"transformers": "5.24.0", "accelerate": "1.16.0"}) == (
        "accelerate 1.15.0 (1.16.0)"
    )
    assert missing(pins, {"transformers": "5.25.0", "accelerate": None}) == (
        "accelerate 1.15.0 (not installed), transformers 5.24 (5.25.0)"
    )
    sources = "".join(
        p.read_text(encoding="utf-8") for p in (ROOT / "tests" / "frameworks").rglob("*.py")
    )
    assert "importorskip" not in sources and "pytest.skip" not in sources


def test_rows_name_the_check_and_what_failed_it() -> None:
    """``observe`` turns a report into rows: kept tensors and their modules, other tensors, the
    outputs, the contract's own control; passing findings are no row, a crash is one."""
    import torch

    from pytest_fp32keep.contract.report import ContractReport, Finding, KeptTensor
    from tests.frameworks import observe

    def finding(check: Any, subject: str, ok: bool = False) -> Finding:
        return Finding(check, subject, "float32", "bfloat16", ok)

    report = ContractReport(
        model_name="M",
        dtype=torch.bfloat16,
        context="autocast",
        kept=(KeptTensor("mlp.gate.weight", "gate.weight", "strict", "float32", "bfloat16"),),
        findings=(
            finding("materialized", "mlp.gate.weight (call 0)"),
            finding("operators", "mlp.gate call 0"),
            finding("stored", "mlp.up.weight"),
            finding("parity", "loss"),
            finding("parity", "control (same units, correct policy)"),
            finding("boundary", "mlp.up call 0 input args[0]", ok=True),
        ),
    )
    assert observe.rows_of(report) == {
        "materialized (kept)",
        "operators (kept)",
        "stored (not kept)",
        "parity (output)",
        "parity (control)",
    }

    def crashing() -> ContractReport:
        raise ValueError("tied\nsecond line")

    crashed = observe.observe(crashing)
    assert crashed.rows == {"crash: ValueError"}
    assert crashed.crash is not None and crashed.crash.startswith("ValueError: tied (at crashing,")
    assert observe.observe(lambda: report).rows == frozenset()  # returned: the contract held
