"""The distributions a user meets first: the wheel, the sdist, and the sdist's own tests.

Builds both with ``python -m build`` (the wheel from the sdist, as pip builds one from PyPI)
into a temporary folder, once per module, then checks that

- the wheel carries the licence and SPDX metadata (``License-Expression``, ``License-File``,
  ``Project-URL``) and exactly the repository's package sources, nothing missing (a package left
  out of pyproject's ``packages``) and nothing stale (a stale ``build/`` once shipped a deleted
  module);
- the sdist carries everything its test suite reads (MANIFEST.in), and a fast subset of those
  tests passes in the unpacked sdist, outside this checkout, against the sdist's own code.

No ranks; about 10 s here (the isolated build asks the index for setuptools; the inner run
imports torch).
Needs the ``build`` package (the ``test`` extra); without it the tests fail and say so.
"""

from __future__ import annotations

import dataclasses
import email.message
import email.parser
import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the `ci` package; appended, so installed packages still win

from ci.matrix import read_toml  # noqa: E402
from tests.inner_outcomes import assert_passed, run_inner_session  # noqa: E402
from tests.plugin._inner import PASSING_MARKED_TEST  # noqa: E402

PACKAGES = {"pytest_fp32keep": ROOT / "pytest_fp32keep", "fp32keep": ROOT / "impl" / "fp32keep"}
"""Each import package the wheel ships -> the repository folder it is built from."""

SDIST_FOLDERS = ("tests", "ci", "docs", "examples", "bench", ".github")
"""Folders the sdist carries whole: the test suite and everything it reads."""

SDIST_FILES = (
    "LICENSE",
    "MANIFEST.in",
    "README.md",
    "pyproject.toml",
    "noxfile.py",
    "tox.ini",
    ".ci/run",
)

NOT_SOURCES = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
"""Folder names holding caches, never sources: neither distribution may carry them."""

SCRATCH = ("bench/out",)
"""Git-ignored output folders inside source folders (the benchmarks' scratch): not sources."""

SDIST_TESTS = (
    "tests/test_architecture.py",
    "tests/test_errors_doc.py",
    "tests/test_ci_matrix.py",
    "tests/core/test_plan.py",
)
"""The fast, rank-free subset of its own suite that must pass in an unpacked sdist."""

WHERE_FROM = (
    "import importlib.util, sys\n"
    "for name in sys.argv[1:]:\n"
    "    spec = importlib.util.find_spec(name)\n"
    "    print(name, spec.origin if spec and spec.origin else '(not found)')\n"
)
"""Prints where each named top-level module would be imported from (imports nothing)."""

URL_LABELS = {"Homepage", "Repository", "Issues", "Documentation"}
BUILD_TIMEOUT_S = 300
INNER_RUN_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path

    def wheel_names(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as wheel:
            return wheel.namelist()

    def wheel_file(self, name: str) -> bytes:
        with zipfile.ZipFile(self.wheel) as wheel:
            return wheel.read(name)

    def dist_info(self) -> str:
        folders = {name.split("/")[0] for name in self.wheel_names()}
        found = [folder for folder in folders if folder.endswith(".dist-info")]
        assert len(found) == 1, f"the wheel has dist-info folders {found}"
        return found[0]

    def sdist_names(self) -> set[str]:
        """The sdist's files, relative to its one top folder (``pytest_fp32keep-0.1.0/``)."""
        with tarfile.open(self.sdist) as sdist:
            names = [member.name for member in sdist.getmembers() if member.isfile()]
        tops = {name.split("/")[0] for name in names}
        assert len(tops) == 1, f"the sdist has top folders {sorted(tops)}"
        return {name.split("/", 1)[1] for name in names}


def _tail(text: str, chars: int = 6000) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """The sdist, and the wheel built from it, of the current checkout."""
    if importlib.util.find_spec("build") is None:
        pytest.fail(
            "tests/test_packaging.py needs the `build` package: `pip install build`, or install "
            "the test extra: `pip install -e '.[test]'`",
            pytrace=False,
        )
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert built.returncode == 0, (
        f"python -m build failed (exit {built.returncode}):\n"
        f"{_tail(built.stdout)}\n{_tail(built.stderr)}"
    )
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert (len(sdists), len(wheels)) == (1, 1), f"built {sorted(p.name for p in out.iterdir())}"
    return Dists(sdist=sdists[0], wheel=wheels[0])


def _metadata(dists: Dists) -> email.message.Message:
    text = dists.wheel_file(f"{dists.dist_info()}/METADATA").decode("utf-8")
    return email.parser.Parser().parsestr(text)


def _sources(folder: Path, pattern: str = "*") -> list[Path]:
    """Files under ``folder`` matching ``pattern``, caches and bytecode left out."""
    return sorted(
        path
        for path in folder.rglob(pattern)
        if path.is_file()
        and not NOT_SOURCES.intersection(path.relative_to(ROOT).parts)
        and not path.relative_to(ROOT).as_posix().startswith(tuple(f"{d}/" for d in SCRATCH))
        and path.suffix not in (".pyc", ".pyo")
    )


# --- the wheel ---------------------------------------------------------------------------------


def test_wheel_carries_the_licence(dists: Dists) -> None:
    names = dists.wheel_names()
    licences = [name for name in names if "/licenses/" in name]
    assert licences == [f"{dists.dist_info()}/licenses/LICENSE"]
    assert dists.wheel_file(licences[0]) == (ROOT / "LICENSE").read_bytes()
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "APPENDIX: How to apply the Apache License to your work." in text


def test_wheel_metadata_is_spdx_with_project_urls(dists: Dists) -> None:
    metadata = _metadata(dists)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["License"] is None, "the deprecated License field is back"
    classifiers = metadata.get_all("Classifier") or []
    assert not [c for c in classifiers if c.startswith("License ::")], "SPDX forbids these"
    urls: dict[str, str] = {}
    for line in metadata.get_all("Project-URL") or []:
        label, url = line.split(",", 1)
        urls[label.strip()] = url.strip()
    declared = read_toml(ROOT / "pyproject.toml")["project"]["urls"]
    assert urls == declared
    assert set(urls) == URL_LABELS
    assert all(url.startswith("https://github.com/pytest-fp32keep/") for url in urls.values())


def test_wheel_ships_exactly_the_package_sources(dists: Dists) -> None:
    names = dists.wheel_names()
    shipped = {name for name in names if name.endswith(".py")}
    expected = {
        f"{package}/{path.relative_to(folder).as_posix()}"
        for package, folder in PACKAGES.items()
        for path in _sources(folder, "*.py")
    }
    missing, stale = sorted(expected - shipped), sorted(shipped - expected)
    assert missing == [], f"modules the wheel lacks (pyproject's packages list?): {missing}"
    assert stale == [], f"modules the wheel ships that the repository does not have: {stale}"
    assert {name.split("/")[0] for name in names} == {*PACKAGES, dists.dist_info()}
    data = sorted(n for n in names if not n.endswith(".py") and n.split("/")[0] in PACKAGES)
    assert data == ["fp32keep/py.typed", "pytest_fp32keep/py.typed"]


# --- the sdist ---------------------------------------------------------------------------------


def test_sdist_carries_what_its_tests_read(dists: Dists) -> None:
    carried = dists.sdist_names()
    expected = set(SDIST_FILES)
    for folder in (*SDIST_FOLDERS, *(str(p.relative_to(ROOT)) for p in PACKAGES.values())):
        expected |= {path.relative_to(ROOT).as_posix() for path in _sources(ROOT / folder)}
    missing = sorted(expected - carried)
    assert missing == [], f"the sdist lacks (MANIFEST.in?): {missing}"
    caches = sorted(
        name
        for name in carried
        if NOT_SOURCES.intersection(name.split("/")) or name.endswith((".pyc", ".pyo"))
    )
    assert caches == [], f"the sdist carries caches or bytecode: {caches}"


@pytest.mark.slow  # the default tier checks what the sdist carries, and runs the installed wheel
def test_unpacked_sdist_passes_its_own_tests(dists: Dists, tmp_path: Path) -> None:
    """The subset runs from the unpacked folder against its own code, not this checkout's."""
    with tarfile.open(dists.sdist) as sdist:
        if hasattr(tarfile, "data_filter"):
            sdist.extractall(tmp_path, filter="data")
        else:  # pragma: no cover - Python 3.10 before 3.10.12
            sdist.extractall(tmp_path)
    (unpacked,) = tmp_path.iterdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    # Ahead of site-packages (and of an editable install's finder): the sdist's own packages.
    env["PYTHONPATH"] = os.pathsep.join([str(unpacked), str(unpacked / "impl")])
    origins = subprocess.run(
        [sys.executable, "-c", WHERE_FROM, *PACKAGES, "ci", "tests"],
        cwd=unpacked,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    outside = [line for line in origins if not Path(line.split(" ", 1)[1]).is_relative_to(unpacked)]
    assert outside == [], f"not imported from the unpacked sdist: {outside}"

    run = run_inner_session(unpacked, {}, "-q", *SDIST_TESTS, timeout=INNER_RUN_TIMEOUT_S, env=env)
    output = run.output
    assert run.returncode == 0, f"pytest in the unpacked sdist exited {run.returncode}:\n" + _tail(
        output
    )
    summary = output.strip().splitlines()[-1]
    assert " passed" in summary, summary


def test_installed_wheel_runs_marked_tests_under_warnings_as_errors(
    dists: Dists, tmp_path: Path
) -> None:
    """As a user meets it: the wheel installed (not editable), a project outside this checkout,
    ``-W error``. An installed wheel makes pytest mark the package for assertion rewriting, and
    ``python -m`` in each rank imports it first: the warning must not stop the ranks."""
    site = tmp_path / "site"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            site,
            dists.wheel,
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert installed.returncode == 0, _tail(installed.stderr)
    project = tmp_path / "user-project"
    project.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the checkout's editable install
    env.pop("PYTEST_ADDOPTS", None)
    where = subprocess.run(
        [sys.executable, "-c", WHERE_FROM, "pytest_fp32keep"],
        cwd=project, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert str(site) in where.stdout, f"not imported from the installed wheel: {where.stdout}"
    files = {"test_user.py": PASSING_MARKED_TEST}
    run = run_inner_session(
        project, files, "-q", "-W", "error", timeout=INNER_RUN_TIMEOUT_S, env=env
    )
    assert run.returncode == 0, _tail(run.output)
    assert_passed(run.outcomes["test_collective"])
    assert "1 passed" in run.output
    version = subprocess.run(
        [str(site / "bin" / "fp32keep"), "--version"],
        cwd=project, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (
        version.stdout.strip()
        == f"fp32keep {read_toml(ROOT / 'pyproject.toml')['project']['version']}"
    )
