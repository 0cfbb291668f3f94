"""The CI configuration agrees with ``ci/matrix.toml``, the one source of truth for versions.

Fails when ``noxfile.py``, ``tox.ini``, a workflow under ``.github/workflows/``, pyproject's lower
bounds or the generated ``docs/matrix.md`` name a Python, torch or Transformers version, a
session, a runner label or a pytest argument that the matrix does not (or miss one it does). Also
covers the matrix tooling itself (``ci/matrix.py``, ``ci/matrix_report.py``).

The workflow checks need PyYAML (a Transformers dependency) and the noxfile check needs nox; where
either is missing those tests skip, except under ``FP32KEEP_CI_STRICT=1`` (``nox -s lint``), where
they fail.
"""

from __future__ import annotations

import configparser
import dataclasses
import datetime as dt
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the `ci` package; appended, so installed packages still win

from ci import matrix_report  # noqa: E402
from ci.matrix import (  # noqa: E402
    MATRIX_PATH,
    Matrix,
    MatrixError,
    TorchPin,
    TransformersPin,
    load_matrix,
    parse_matrix,
    read_toml,
)

AUX_SESSIONS = frozenset(
    {"lint", "bench", "matrix-report", "families", "frameworks", "world-sizes", "keep-policy"}
)
"""The noxfile's sessions that do not come from the matrix."""

GITHUB_RUNNER_LABELS = frozenset(
    {"self-hosted", "linux", "windows", "macos", "x64", "arm", "arm64"}
)
"""Labels GitHub gives every self-hosted runner; any other label is custom (actionlint.yaml)."""

WORKFLOWS = ROOT / ".github" / "workflows"
STRICT = os.environ.get("FP32KEEP_CI_STRICT") == "1"


def _require(module: str) -> ModuleType:
    """Import ``module``; skip the test without it, unless strict (then the import error fails)."""
    if STRICT:
        return importlib.import_module(module)
    imported: ModuleType = pytest.importorskip(module)
    return imported


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    return load_matrix()


# --- the matrix file and its objects ------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["python"].update(default="3.9"), "python.default"),
        (lambda d: d["python"].update(versions=["3.11", "3.11"]), "twice"),
        (lambda d: d["transformers"].update(labels=["4.56", "5"]), "neither X.Y"),
        (lambda d: d["transformers"].update(default="9.9"), "transformers.default"),
        (lambda d: d["torch_axis"][0].update(transformers=["9.9"]), "torch_axis[0].transformers"),
        (lambda d: d["torch_axis"][0].update(version="two"), "torch_axis[0].version"),
        (lambda d: d["torch_axis"][1].update(session="torch-2.9"), "share a name"),
        (lambda d: d["ci"]["cpu"].update(every_python=["9.9"]), "ci.cpu.every_python"),
        (lambda d: d["ci"]["gpu"].update(sessions=["tests-9.9"]), "ci.gpu.sessions"),
        (lambda d: d["torch"].update(default="latest"), "torch.default"),
    ],
)
def test_matrix_rejects_contradictions(mutate: Any, message: str) -> None:
    data = read_toml(MATRIX_PATH)
    mutate(data)
    with pytest.raises(MatrixError, match=re.escape(message)):
        parse_matrix(data)


def test_pins_spell_pip_requirements() -> None:
    assert TransformersPin("4.56").requirement == "transformers==4.56.*"
    assert TransformersPin("5.0").install_args == ("transformers==5.0.*",)
    assert TransformersPin("latest").install_args == ("--upgrade", "transformers")
    assert TransformersPin("5.10").session == "tests-5.10"
    assert TransformersPin("5.10").tox_factor == "tf510"
    assert TorchPin("2.13.0").requirement == "torch==2.13.0"
    assert TorchPin("2.6").requirement == "torch==2.6.*"
    assert TorchPin("newest").install_args == ("--upgrade", "torch")


def test_pyproject_lower_bounds_are_the_matrix_oldest(matrix: Matrix) -> None:
    """pyproject's ``torch>=``, ``transformers>=`` and ``requires-python`` are what CI tests."""
    project = read_toml(ROOT / "pyproject.toml")["project"]
    found = (re.fullmatch(r"(torch|transformers)>=([\d.]+)", d) for d in project["dependencies"])
    bounds = {m[1]: m[2] for m in found if m}
    fixed = [p.label for p in matrix.transformers if not p.is_latest]
    oldest_torch = min(
        (e.torch.version for e in matrix.torch_axis if not e.torch.is_newest),
        key=lambda v: tuple(int(x) for x in v.split(".")),
    )
    assert bounds == {"torch": oldest_torch, "transformers": fixed[0]}
    assert project["requires-python"] == f">={matrix.pythons[0]}"


# --- noxfile.py --------------------------------------------------------------------------------


def _nox_sessions() -> dict[str, tuple[str, str]]:
    """Every noxfile session: name -> (tags, description), from ``nox --list``."""
    _require("nox")
    listing = subprocess.run(
        [sys.executable, "-m", "nox", "--noxfile", str(ROOT / "noxfile.py"), "--list"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    sessions = {}
    for line in listing.splitlines():
        found = re.fullmatch(r"[*-] (\S+)( \[[^]]*\])?(?: -> (.*))?", line)
        if found:
            sessions[found[1]] = ((found[2] or "").strip(" []"), found[3] or "")
    return sessions


def test_noxfile_sessions_are_the_matrix(matrix: Matrix) -> None:
    sessions = _nox_sessions()
    assert set(sessions) == set(matrix.session_names) | AUX_SESSIONS
    for pin in matrix.transformers:
        assert pin.description in sessions[pin.session][1], pin.session
        assert matrix.torch.description in sessions[pin.session][1], pin.session
    for entry in matrix.torch_axis:
        description = sessions[entry.session][1]
        assert entry.torch.description in description
        assert description.endswith(", ".join(p.label for p in entry.transformers) + ".")


def _nox_with_a_missing_interpreter(*options: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``nox -s lint`` on an interpreter no machine has, as a developer runs it (no CI variable)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GITHUB_ACTIONS")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nox",
            "--noxfile",
            str(ROOT / "noxfile.py"),
            "-s",
            "lint",
            "--force-python",
            "3.99",
            *options,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def test_a_missing_interpreter_fails_the_session_outside_ci(tmp_path: Path) -> None:
    _require("nox")
    run = _nox_with_a_missing_interpreter(cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "Python interpreter 3.99 not found" in run.stderr
    assert "skipped" not in run.stderr
    # The control: nox's own default outside CI, which the noxfile overrides, is a skip and exit 0.
    control = _nox_with_a_missing_interpreter("--no-error-on-missing-interpreters", cwd=tmp_path)
    assert control.returncode == 0, control.stderr
    assert "skipped: Python interpreter 3.99 not found" in control.stderr


# --- tox.ini -----------------------------------------------------------------------------------


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini", encoding="utf-8")
    return parser


def _expand_braces(spec: str) -> set[str]:
    """tox's generative env list: ``py{310,311}-tf{456}`` -> ``py310-tf456``, ``py311-tf456``."""
    parts = re.split(r"(\{[^}]*\})", spec)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return {"".join(combo) for combo in itertools.product(*choices)}


def _mapping(text: str) -> dict[str, str]:
    pairs = (line.split(":", 1) for line in text.strip().splitlines())
    return {key.strip(): value.strip() for key, value in pairs}


def test_tox_env_list_is_python_times_transformers(matrix: Matrix) -> None:
    envs = set().union(*(_expand_braces(s) for s in _tox()["tox"]["env_list"].split()))
    assert envs == {
        f"py{python.replace('.', '')}-{pin.tox_factor}"
        for python in matrix.pythons
        for pin in matrix.transformers
    }


def test_tox_gh_actions_maps_the_matrix(matrix: Matrix) -> None:
    tox = _tox()
    assert _mapping(tox["gh-actions"]["python"]) == {
        python: f"py{python.replace('.', '')}" for python in matrix.pythons
    }
    assert _mapping(tox["gh-actions:env"]["TRANSFORMERS"]) == {
        pin.label: pin.tox_factor for pin in matrix.transformers
    }


def test_tox_deps_pin_the_matrix_versions(matrix: Matrix) -> None:
    deps = [line.strip() for line in _tox()["testenv"]["deps"].strip().splitlines()]
    assert deps[0] == matrix.torch.requirement
    factored = _mapping("\n".join(line for line in deps if ":" in line))
    assert factored == {pin.tox_factor: pin.requirement for pin in matrix.transformers}
    assert len(deps) == 1 + len(factored)


# --- .github/workflows -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workflows() -> dict[str, dict[str, Any]]:
    yaml = _require("yaml")
    return {
        path.stem: cast(dict[str, Any], yaml.safe_load(path.read_text(encoding="utf-8")))
        for path in sorted(WORKFLOWS.glob("*.yml"))
    }


def _steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def _runs(workflow: dict[str, Any]) -> list[str]:
    return [step["run"] for step in _steps(workflow) if "run" in step]


def test_workflows_exist(workflows: dict[str, dict[str, Any]]) -> None:
    assert {"cpu", "gpu", "lint"} <= set(workflows)


@pytest.mark.parametrize(("name", "job"), [("cpu", "tests"), ("gpu", "nccl")])
def test_job_matrix_is_printed_from_the_matrix_source(
    workflows: dict[str, dict[str, Any]], name: str, job: str
) -> None:
    jobs = workflows[name]["jobs"]
    assert jobs[job]["strategy"]["matrix"] == f"${{{{ fromJSON(needs.matrix.outputs.{name}) }}}}"
    assert jobs[job]["needs"] == "matrix"
    printer = f'echo "{name}=$(python -m ci.matrix github {name})" >> "$GITHUB_OUTPUT"'
    assert [step["run"] for step in jobs["matrix"]["steps"] if "run" in step] == [printer]


def test_printed_job_matrix_is_the_matrix(matrix: Matrix) -> None:
    for workflow in ("cpu", "gpu"):
        printed = subprocess.run(
            [sys.executable, "-m", "ci.matrix", "github", workflow],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        assert json.loads(printed) == matrix.github_matrix(workflow)


def test_cpu_job_matrix_covers_every_session_and_python(matrix: Matrix) -> None:
    jobs = {(job["session"], job["python"]) for job in matrix.github_matrix("cpu")["include"]}
    assert {session for session, _ in jobs} == set(matrix.session_names)
    assert {python for _, python in jobs} == set(matrix.pythons)
    for pin in matrix.cpu_every_python:
        assert {(pin.session, python) for python in matrix.pythons} <= jobs


def test_setup_python_uses_the_matrix(workflows: dict[str, dict[str, Any]], matrix: Matrix) -> None:
    for name, workflow in workflows.items():
        for step in _steps(workflow):
            if str(step.get("uses", "")).startswith("actions/setup-python@"):
                version = str(step["with"]["python-version"])
                assert version in ("${{ matrix.python }}", matrix.default_python), name


def test_nox_calls_name_real_sessions(workflows: dict[str, dict[str, Any]], matrix: Matrix) -> None:
    known = set(matrix.session_names) | AUX_SESSIONS | {'"$SESSION"'}
    calls = [
        session
        for workflow in workflows.values()
        for run in _runs(workflow)
        for session in re.findall(r"\bnox -s (\S+)", run)
    ]
    assert calls
    assert set(calls) <= known


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_test_jobs_pass_the_matrix_pytest_args(
    workflows: dict[str, dict[str, Any]], matrix: Matrix, name: str
) -> None:
    args = matrix.cpu_pytest_args if name == "cpu" else matrix.gpu_pytest_args
    expected = f'nox -s "$SESSION" --force-python "$PYTHON" -- {" ".join(args)}'
    assert expected in _runs(workflows[name])


def test_gpu_runners_are_the_documented_labels(
    workflows: dict[str, dict[str, Any]], matrix: Matrix
) -> None:
    yaml = _require("yaml")
    assert workflows["gpu"]["jobs"]["nccl"]["runs-on"] == list(matrix.gpu_runner_labels)
    assert "--fsdp-backend=nccl" in matrix.gpu_pytest_args
    config = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text(encoding="utf-8"))
    custom = [label for label in matrix.gpu_runner_labels if label not in GITHUB_RUNNER_LABELS]
    assert config["self-hosted-runner"]["labels"] == custom
    header = (WORKFLOWS / "gpu.yml").read_text(encoding="utf-8")
    docs = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    listed = ", ".join(matrix.gpu_runner_labels)
    assert listed in header
    assert listed in docs


def test_families_workflow_runs_the_session_and_keeps_what_it_writes(
    workflows: dict[str, dict[str, Any]],
) -> None:
    """families.yml: weekly and by hand, ``nox -s families``; the page and build/families/ (the
    reports and the oracle's JUnit XML) uploaded also when the session fails; a job timeout that
    outlasts every run's check timeout plus 10 minutes per run (install, oracle): one per label
    and the FP32-masters run, and stays within GitHub's 360-minute limit for hosted runners."""
    job = _scheduled_session_job(
        workflows["families"], "families", {"docs/families.md", "build/families/"}
    )
    families = read_toml(MATRIX_PATH)["families"]
    runs = len(families["transformers"]) + 1  # + fp32_masters
    needed = runs * (families["timeout_s"] / 60 + 10)
    assert needed <= job["timeout-minutes"] <= 360


def test_families_fp32_masters_run_is_a_label_on_the_policy_torch(matrix: Matrix) -> None:
    """[families] fp32_masters names a Transformers label of the matrix and an exact torch that
    has ``param_dtype_override_fn`` (2.15, the first; a later one is fine), and the ``families``
    session says it runs it."""
    masters = read_toml(MATRIX_PATH)["families"]["fp32_masters"]
    assert set(masters) == {"transformers", "torch"}
    assert masters["transformers"] in {pin.label for pin in matrix.transformers}
    torch = TorchPin(masters["torch"])
    assert not torch.is_newest
    assert tuple(int(part) for part in torch.version.split(".")[:2]) >= (2, 15)
    assert "then the fp32_masters run" in _nox_sessions()["families"][1]


def test_bench_workflow_runs_the_session_and_keeps_what_it_writes(
    workflows: dict[str, dict[str, Any]],
) -> None:
    """bench.yml: weekly and by hand, ``nox -s bench`` on a hosted runner with PyTorch's CPU
    wheels; the regenerated bench/RESULTS.md and every benchmark's JSON uploaded also when a
    benchmark crashed; a job timeout within GitHub's 360-minute limit."""
    job = _scheduled_session_job(workflows["bench"], "bench", {"bench/RESULTS.md", "bench/out/"})
    assert job["runs-on"] == "ubuntu-latest"
    assert job["timeout-minutes"] <= 360


def _scheduled_session_job(
    workflow: dict[str, Any], session: str, kept: set[str]
) -> dict[str, Any]:
    """The job ``session`` of a workflow that runs on a schedule and by hand, after checking
    that it runs ``nox -s SESSION`` and uploads ``kept`` also when the session failed."""
    raw = cast(dict[Any, Any], workflow)
    triggers = raw["on"] if "on" in raw else raw[True]  # PyYAML reads a bare `on` as True
    assert {"schedule", "workflow_dispatch"} <= set(triggers)
    job: dict[str, Any] = workflow["jobs"][session]
    assert any(run.strip() == f"nox -s {session}" for run in _runs({"jobs": {"j": job}}))
    [upload] = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-")]
    assert upload["if"] == "always()"
    assert kept <= set(upload["with"]["path"].split())
    return job


def test_cpu_workflows_install_cpu_torch_wheels(workflows: dict[str, dict[str, Any]]) -> None:
    for name in ("cpu", "lint", "bench"):
        assert "PIP_EXTRA_INDEX_URL" in workflows[name]["env"], name
    assert "PIP_EXTRA_INDEX_URL" not in workflows["gpu"].get("env", {})


# --- ci/matrix_report.py and docs/matrix.md ----------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="tests-5.10" errors="1" failures="2"
 skipped="3" tests="10" time="12.34"/></testsuites>
"""


def test_read_junit_counts(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT, encoding="utf-8")
    counts = matrix_report.read_junit(path)
    assert (counts.passed, counts.failures, counts.errors, counts.skipped) == (4, 2, 1, 3)
    assert matrix_report.read_junit(tmp_path / "missing.xml").tests == 0


def test_record_merge_render(tmp_path: Path, matrix: Matrix) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT, encoding="utf-8")
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    results, junit_dir = tmp_path / "results", tmp_path / "junit"
    pin = matrix.default_transformers
    for exit_code, now in ((0, when - dt.timedelta(days=1)), (1, when)):
        record = matrix_report.record_run(
            session=pin.session,
            label=pin.label,
            junit=junit,
            exit_code=exit_code,
            pytest_args=["-k", "a|b"],
            results_dir=results,
            junit_dir=junit_dir,
            now=now,
        )
    assert (junit_dir / f"{record.key}.xml").is_file()
    older = dataclasses.replace(record, date="2000-01-01T00:00:00Z")
    gone = dataclasses.replace(record, session="tests-0.1", label="0.1")
    merged = matrix_report.merge([older, gone], matrix_report.read_records(results), matrix)
    assert merged == [record]
    assert record.outcome == "failed"
    text = matrix_report.render(results, tmp_path / "data.json", tmp_path / "table.md", matrix)
    assert text == (tmp_path / "table.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith(f"| `{pin.session}`"))
    assert "| failed | 4 | 2 | 1 | 3 | 12.3 | `-k` `a\\|b` |" in row
    assert "2026-01-02 03:04:05Z" in row
    for other in matrix.transformers:
        if other != pin:
            assert f"- `{other.session}` with Transformers {other.label}" in text


def test_docs_matrix_table_is_rendered_from_its_data(matrix: Matrix) -> None:
    """docs/matrix.md is exactly what ``nox -s matrix-report`` renders: never edited by hand."""
    data = matrix_report.load_data(ROOT / matrix_report.DATA_PATH)
    rendered = matrix_report.render_markdown(matrix_report.merge(data, [], matrix), matrix)
    table = (ROOT / matrix_report.TABLE_PATH).read_text(encoding="utf-8")
    assert table == rendered, "docs/matrix.md is stale or hand-edited: run nox -s matrix-report"


TRANSFORMERS_IMPORT = re.compile(
    r"^\s*(?:import\s+transformers\b|from\s+transformers\b)|import_module\(\s*['\"]transformers",
    re.MULTILINE,
)
"""An import of Transformers, static or through importlib."""


def ci_run_transformers_independent() -> list[str]:
    """The paths `.ci/run` leaves out of the 4.56 and newest-release sessions."""
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    found = re.search(r"^TRANSFORMERS_INDEPENDENT=\(([^)]*)\)", text, re.MULTILINE)
    assert found, ".ci/run no longer defines TRANSFORMERS_INDEPENDENT=(...)"
    return found.group(1).split()


def transformers_importers(paths: list[Path]) -> list[str]:
    """The Python files under ``paths`` that import Transformers."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return [str(f) for f in files if TRANSFORMERS_IMPORT.search(f.read_text(encoding="utf-8"))]


def test_what_ci_runs_once_imports_no_transformers() -> None:
    """`.ci/run` runs tests/plugin and tests/test_packaging.py at one Transformers version only:
    that is sound while neither they nor the plugin they load import Transformers."""
    paths = [ROOT / p for p in ci_run_transformers_independent()]
    assert paths and all(p.exists() for p in paths), paths
    assert transformers_importers(paths) == []
    probe = (
        "import sys, pytest_fp32keep.plugin, pytest_fp32keep.fixtures, pytest_fp32keep.runner\n"
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "loading the plugin imports Transformers"


def test_a_transformers_import_is_found(tmp_path: Path) -> None:
    """Negative control for the check above: every spelling of the import is caught."""
    spellings = (
        "import transformers",
        "from transformers import AutoModel",
        "    import transformers.x",
        'importlib.import_module("transformers")',
    )
    for index, line in enumerate(spellings):
        (tmp_path / f"t{index}.py").write_text(f"x = 1\n{line}\n", encoding="utf-8")
    (tmp_path / "clean.py").write_text("# transformers are mentioned, not imported\n")
    assert len(transformers_importers([tmp_path])) == 4
