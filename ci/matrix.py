"""The CI version matrix: ``ci/matrix.toml`` read into immutable, validated objects.

Every consumer reads versions from here, so that the TOML file is the only place they are
written down: ``noxfile.py`` generates its sessions from :func:`load_matrix`, the GitHub
workflows take their job matrices from ``python -m ci.matrix github cpu|gpu``, and
``tests/test_ci_matrix.py`` compares ``tox.ini`` and the workflows against it.

Standard library only: the workflows' matrix job runs it on a bare interpreter.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox and pytest both install tomli on Python 3.10
    import tomli as tomllib

MATRIX_PATH = Path(__file__).with_name("matrix.toml")
"""Where the matrix lives; the default of :func:`load_matrix`."""

LATEST = "latest"
"""The Transformers label meaning "the newest release the interpreter supports"."""

NEWEST = "newest"
"""The torch version meaning "the newest release pip may install"."""

Workflow = Literal["cpu", "gpu"]

_LABEL = re.compile(r"\d+\.\d+")
_TORCH_VERSION = re.compile(r"\d+\.\d+(\.\d+)?")
_PYTHON = re.compile(r"3\.\d+")


class MatrixError(ValueError):
    """``ci/matrix.toml`` is malformed or contradicts itself; the message names the field."""


@dataclass(frozen=True)
class TransformersPin:
    """One Transformers line of the matrix.

    ``label`` is ``"X.Y"`` (install ``transformers==X.Y.*``, the newest patch of that minor) or
    ``"latest"`` (install the newest release with ``pip install --upgrade``).
    """

    label: str

    @property
    def is_latest(self) -> bool:
        """Whether this pin follows the newest release instead of a fixed minor version."""
        return self.label == LATEST

    @property
    def specifier(self) -> str:
        """The PEP 440 specifier (``"==4.56.*"``), empty for ``latest``."""
        return "" if self.is_latest else f"=={self.label}.*"

    @property
    def requirement(self) -> str:
        """The pip requirement, e.g. ``transformers==4.56.*`` or ``transformers``."""
        return f"transformers{self.specifier}"

    @property
    def install_args(self) -> tuple[str, ...]:
        """Arguments for ``pip install`` that put this version into an existing venv."""
        return ("--upgrade", self.requirement) if self.is_latest else (self.requirement,)

    @property
    def description(self) -> str:
        """For people: ``transformers==4.56.*`` or ``the newest transformers release``."""
        return "the newest transformers release" if self.is_latest else self.requirement

    @property
    def session(self) -> str:
        """The nox session that runs the suite with this version, e.g. ``tests-4.56``."""
        return f"tests-{self.label}"

    @property
    def tox_factor(self) -> str:
        """The tox environment factor, e.g. ``tf456``, ``tf510``, ``tflatest``."""
        return "tf" + self.label.replace(".", "")


@dataclass(frozen=True)
class TorchPin:
    """One PyTorch version: ``"2.13.0"`` (exact), ``"2.6"`` (newest 2.6.x) or ``"newest"``."""

    version: str

    @property
    def is_newest(self) -> bool:
        """Whether this pin follows the newest release pip may install."""
        return self.version == NEWEST

    @property
    def specifier(self) -> str:
        """The PEP 440 specifier: ``"==2.13.0"``, ``"==2.6.*"``, or empty for ``newest``."""
        if self.is_newest:
            return ""
        exact = self.version.count(".") == 2
        return f"=={self.version}" if exact else f"=={self.version}.*"

    @property
    def requirement(self) -> str:
        """The pip requirement, e.g. ``torch==2.13.0``."""
        return f"torch{self.specifier}"

    @property
    def install_args(self) -> tuple[str, ...]:
        """Arguments for ``pip install`` that put this version into an existing venv."""
        return ("--upgrade", self.requirement) if self.is_newest else (self.requirement,)

    @property
    def description(self) -> str:
        """For people: ``torch==2.6.*`` or ``the newest torch release``."""
        return "the newest torch release" if self.is_newest else self.requirement


@dataclass(frozen=True)
class TorchAxisEntry:
    """One session of the PyTorch axis: a torch version and the Transformers lines it runs."""

    session: str
    torch: TorchPin
    transformers: tuple[TransformersPin, ...]


@dataclass(frozen=True)
class Matrix:
    """The whole matrix; see ``ci/matrix.toml`` for what each field means."""

    pythons: tuple[str, ...]
    default_python: str
    torch: TorchPin
    transformers: tuple[TransformersPin, ...]
    default_transformers: TransformersPin
    torch_axis: tuple[TorchAxisEntry, ...]
    cpu_every_python: tuple[TransformersPin, ...]
    cpu_pytest_args: tuple[str, ...]
    gpu_runner_labels: tuple[str, ...]
    gpu_sessions: tuple[str, ...]
    gpu_pytest_args: tuple[str, ...]

    @property
    def test_sessions(self) -> tuple[str, ...]:
        """The ``tests-<label>`` session names, in matrix order."""
        return tuple(pin.session for pin in self.transformers)

    @property
    def session_names(self) -> tuple[str, ...]:
        """Every session the matrix defines: the ``tests-*`` ones, then the PyTorch axis."""
        return self.test_sessions + tuple(entry.session for entry in self.torch_axis)

    def github_matrix(self, workflow: Workflow) -> dict[str, list[dict[str, str]]]:
        """The ``strategy.matrix`` of a workflow's test job: ``{"include": [{session, python}]}``.

        ``cpu``: every session on the default Python, plus the ``ci.cpu.every_python`` sessions on
        every other Python. ``gpu``: the ``ci.gpu.sessions`` on the default Python.
        """
        jobs: list[dict[str, str]] = []
        if workflow == "cpu":
            for name in self.session_names:
                jobs.append({"session": name, "python": self.default_python})
            for pin in self.cpu_every_python:
                for python in self.pythons:
                    if python != self.default_python:
                        jobs.append({"session": pin.session, "python": python})
        else:
            jobs = [{"session": name, "python": self.default_python} for name in self.gpu_sessions]
        return {"include": jobs}


def _table(data: Mapping[str, Any], key: str, parent: str = "") -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise MatrixError(f"[{parent}{key}] must be a table")
    return value


def _strings(
    table: Mapping[str, Any], key: str, where: str, pattern: re.Pattern[str] | None = None
) -> tuple[str, ...]:
    value = table.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MatrixError(f"{where}.{key} must be a list of strings, got {value!r}")
    if len(set(value)) != len(value):
        raise MatrixError(f"{where}.{key} lists a value twice: {value!r}")
    if pattern is not None:
        bad = [v for v in value if not pattern.fullmatch(v)]
        if bad:
            raise MatrixError(f"{where}.{key}: malformed value(s) {bad!r}")
    return tuple(value)


def _string(table: Mapping[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str):
        raise MatrixError(f"{where}.{key} must be a string, got {value!r}")
    return value


def _member(value: str, allowed: Sequence[str], where: str) -> str:
    if value not in allowed:
        raise MatrixError(f"{where} = {value!r} is not one of {list(allowed)!r}")
    return value


def parse_matrix(data: Mapping[str, Any]) -> Matrix:
    """Validate the parsed TOML and build the :class:`Matrix`; :class:`MatrixError` if invalid."""
    python = _table(data, "python")
    pythons = _strings(python, "versions", "python", _PYTHON)
    default_python = _member(_string(python, "default", "python"), pythons, "python.default")

    torch_version = _string(_table(data, "torch"), "default", "torch")
    if not _TORCH_VERSION.fullmatch(torch_version):
        raise MatrixError(f"torch.default = {torch_version!r} is not a version like 2.13.0")

    tf = _table(data, "transformers")
    labels = _strings(tf, "labels", "transformers")
    bad = [label for label in labels if label != LATEST and not _LABEL.fullmatch(label)]
    if bad:
        raise MatrixError(f"transformers.labels: {bad!r} are neither X.Y nor {LATEST!r}")
    default_label = _member(_string(tf, "default", "transformers"), labels, "transformers.default")
    pins = tuple(TransformersPin(label) for label in labels)

    axis_rows = data.get("torch_axis", [])
    if not isinstance(axis_rows, list):
        raise MatrixError("[[torch_axis]] must be an array of tables")
    axis: list[TorchAxisEntry] = []
    for index, row in enumerate(axis_rows):
        where = f"torch_axis[{index}]"
        if not isinstance(row, Mapping):
            raise MatrixError(f"{where} must be a table")
        version = _string(row, "version", where)
        if version != NEWEST and not _TORCH_VERSION.fullmatch(version):
            raise MatrixError(f"{where}.version = {version!r} is neither X.Y[.Z] nor {NEWEST!r}")
        axis_labels = _strings(row, "transformers", where)
        for label in axis_labels:
            _member(label, labels, f"{where}.transformers entry")
        axis.append(
            TorchAxisEntry(
                session=_string(row, "session", where),
                torch=TorchPin(version),
                transformers=tuple(TransformersPin(label) for label in axis_labels),
            )
        )

    ci = _table(data, "ci")
    cpu = _table(ci, "cpu", "ci.")
    every_python = _strings(cpu, "every_python", "ci.cpu")
    for label in every_python:
        _member(label, labels, "ci.cpu.every_python entry")
    gpu = _table(ci, "gpu", "ci.")

    matrix = Matrix(
        pythons=pythons,
        default_python=default_python,
        torch=TorchPin(torch_version),
        transformers=pins,
        default_transformers=TransformersPin(default_label),
        torch_axis=tuple(axis),
        cpu_every_python=tuple(TransformersPin(label) for label in every_python),
        cpu_pytest_args=_strings(cpu, "pytest_args", "ci.cpu"),
        gpu_runner_labels=_strings(gpu, "runner_labels", "ci.gpu"),
        gpu_sessions=_strings(gpu, "sessions", "ci.gpu"),
        gpu_pytest_args=_strings(gpu, "pytest_args", "ci.gpu"),
    )
    names = matrix.session_names
    if len(set(names)) != len(names):
        raise MatrixError(f"two sessions share a name: {list(names)!r}")
    for name in matrix.gpu_sessions:
        _member(name, names, "ci.gpu.sessions entry")
    return matrix


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file (``tomllib``, or ``tomli`` on Python 3.10)."""
    with path.open("rb") as handle:
        return tomllib.load(handle)


def load_matrix(path: Path = MATRIX_PATH) -> Matrix:
    """Read and validate the matrix file (``ci/matrix.toml`` unless told otherwise)."""
    return parse_matrix(read_toml(path))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m ci.matrix github cpu|gpu`` or ``python -m ci.matrix sessions``."""
    parser = argparse.ArgumentParser(
        prog="python -m ci.matrix", description="Print the CI version matrix from ci/matrix.toml."
    )
    parser.add_argument("--file", type=Path, default=MATRIX_PATH, help="matrix file to read")
    commands = parser.add_subparsers(dest="command", required=True)
    github = commands.add_parser("github", help="print a workflow's job matrix as one line of JSON")
    github.add_argument("workflow", choices=["cpu", "gpu"])
    commands.add_parser("sessions", help="print the matrix's nox session names, one a line")
    args = parser.parse_args(argv)

    matrix = load_matrix(args.file)
    if args.command == "github":
        print(json.dumps(matrix.github_matrix(args.workflow), separators=(",", ":")))
    else:
        print("\n".join(matrix.session_names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
