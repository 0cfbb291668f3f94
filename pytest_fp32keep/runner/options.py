"""Options, ini keys and the ``fsdp2`` marker, resolved and validated in one place.

Every setting has one validator that takes the raw value and a ``where`` string naming where
the value came from (``--fsdp-nproc``, the ini key, or the marker argument on a test), so a bad
value is reported at the boundary where it entered, before any rank starts.

This module also decides which of the parent's pytest arguments the ranks inherit: the ranks
must collect the same node ids and build the same fixtures, but must not run their own
selection, reporting or distribution (``-k``, ``--lf``, ``--junitxml``, ``-n`` ...).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from collections.abc import Sequence
from typing import Final

import pytest

MARKER_NAME: Final = "fsdp2"

DEFAULT_NPROC: Final = 2
DEFAULT_BACKEND: Final = "auto"
DEFAULT_TIMEOUT_S: Final = 300.0
BACKENDS: Final = ("auto", "gloo", "nccl")
#: The environment variable of the cap, for machines (a CI runner) rather than projects.
ENV_MAX_NPROC: Final = "FP32KEEP_MAX_NPROC"
#: The parameter a marker's list of world sizes becomes (one case per size, ids ``nprocN``);
#: the runner's fixture of the same name gives the same number inside the ranks.
WORLD_SIZE_PARAM: Final = "fsdp2_world_size"
DEFAULT_LAUNCHER: Final = "auto"
LAUNCHERS: Final = ("auto", "local", "external")

HELP_NPROC: Final = (
    "number of ranks (processes started by torchrun) that run each test marked "
    f"@pytest.mark.{MARKER_NAME}, unless the marker says nproc=... (default: {DEFAULT_NPROC}; "
    "ini key: fsdp_nproc)"
)
HELP_BACKEND: Final = (
    "process-group backend of marked tests: 'auto' picks nccl with one CUDA device per rank "
    "when enough devices are visible, else gloo on CPU; 'nccl' skips tests that lack the "
    f"devices (default: {DEFAULT_BACKEND}; ini key: fsdp_backend)"
)
HELP_TIMEOUT: Final = (
    "seconds one marked test may run in its ranks; after that every rank's Python stack is "
    "put in the report, the ranks are killed and the next test gets fresh ones (default: "
    f"{DEFAULT_TIMEOUT_S:g}; ini key: fsdp_timeout)"
)
HELP_MAX_NPROC: Final = (
    "the most ranks a marked test may start: a test (or one world size of a marker's "
    "nproc=[...] list) that needs more is skipped, naming the cap, instead of oversubscribing "
    f"the machine (default: no cap; ini key: fsdp_max_nproc; environment: {ENV_MAX_NPROC})"
)
HELP_LAUNCHER: Final = (
    "who starts the ranks of marked tests: 'local' (the plugin starts --fsdp-nproc ranks of "
    "its own on this machine), 'external' (pytest itself runs in every process of a world "
    "launched by torchrun or srun, and marked tests run in place, SPMD), 'auto' (external "
    "under torchrun, else local; under an srun step of several tasks it asks you to choose) "
    f"(default: {DEFAULT_LAUNCHER}; ini key: fsdp_launcher)"
)
HELP_MARKER: Final = (
    f"{MARKER_NAME}(nproc=None, backend=None, isolated=False, timeout=None): run the test body "
    "in nproc ranks started by torchrun (default --fsdp-nproc; a list such as nproc=[1, 2, 4] "
    "runs the test once per world size, ids nproc1, nproc2 ...), on backend 'auto', 'gloo' or "
    "'nccl' (default --fsdp-backend), for at most timeout seconds (default --fsdp-timeout); "
    "ranks are kept alive across tests unless isolated=True, which gives the test fresh ranks "
    "of its own."
)

_OPTION_NPROC: Final = "--fsdp-nproc"
_OPTION_BACKEND: Final = "--fsdp-backend"
_OPTION_TIMEOUT: Final = "--fsdp-timeout"
_OPTION_MAX_NPROC: Final = "--fsdp-max-nproc"
_INI_NPROC: Final = "fsdp_nproc"
_INI_BACKEND: Final = "fsdp_backend"
_INI_TIMEOUT: Final = "fsdp_timeout"
_INI_MAX_NPROC: Final = "fsdp_max_nproc"
_OPTION_LAUNCHER: Final = "--fsdp-launcher"
_INI_LAUNCHER: Final = "fsdp_launcher"


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """The session-wide defaults, from the command line, else the ini file, else built in.

    Attributes:
        nproc: ranks per marked test when its marker does not say.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``, when the marker does not say.
        timeout: seconds a marked test may run before its ranks are dumped and killed.
        max_nproc: the most ranks a marked test may start (``None``: no cap).
        max_nproc_from: where the cap was set (the option, the environment variable, the ini
            key), for the reason of the tests it skips.
        timeout_from: the timeout and where it was set, as a hang's report says it
            (:func:`timeout_words`).
    """

    nproc: int = DEFAULT_NPROC
    backend: str = DEFAULT_BACKEND
    timeout: float = DEFAULT_TIMEOUT_S
    max_nproc: int | None = None
    max_nproc_from: str = ""
    timeout_from: str = f"{DEFAULT_TIMEOUT_S:g} s (the default of --fsdp-timeout)"


@dataclasses.dataclass(frozen=True)
class ItemSettings:
    """How one marked test runs: the marker's arguments over the session defaults.

    Attributes:
        nproc: number of ranks.
        backend: the requested backend (``"auto"`` is resolved later, by device count).
        isolated: the test gets fresh ranks, started and torn down for it alone.
        timeout: seconds before the ranks are dumped and killed.
        timeout_from: the timeout and where it was set (the marker's ``timeout=``, else the
            session's :attr:`SessionSettings.timeout_from`), as a hang's report says it.
    """

    nproc: int
    backend: str
    isolated: bool
    timeout: float
    timeout_from: str = ""


class MarkerError(ValueError):
    """A ``@pytest.mark.fsdp2`` argument is invalid; the message names the test and argument."""


def add_options(parser: pytest.Parser) -> None:
    """Register the command line options and their ini keys.

    The options keep the raw string (no argparse ``type=``) so that one validator per
    setting reports every bad value the same way, naming where it came from.
    """
    group = parser.getgroup("fp32keep", "FSDP2 multi-rank tests (pytest-fp32keep)")
    group.addoption(_OPTION_NPROC, dest=_INI_NPROC, metavar="N", default=None, help=HELP_NPROC)
    group.addoption(
        _OPTION_BACKEND,
        dest=_INI_BACKEND,
        metavar="{" + ",".join(BACKENDS) + "}",
        default=None,
        help=HELP_BACKEND,
    )
    group.addoption(
        _OPTION_TIMEOUT, dest=_INI_TIMEOUT, metavar="SECONDS", default=None, help=HELP_TIMEOUT
    )
    group.addoption(
        _OPTION_MAX_NPROC, dest=_INI_MAX_NPROC, metavar="N", default=None, help=HELP_MAX_NPROC
    )
    parser.addini(_INI_NPROC, HELP_NPROC, default="")
    parser.addini(_INI_BACKEND, HELP_BACKEND, default="")
    parser.addini(_INI_TIMEOUT, HELP_TIMEOUT, default="")
    parser.addini(_INI_MAX_NPROC, HELP_MAX_NPROC, default="")
    launchers = "{" + ",".join(LAUNCHERS) + "}"
    group.addoption(
        _OPTION_LAUNCHER, dest=_INI_LAUNCHER, metavar=launchers, default=None, help=HELP_LAUNCHER
    )
    parser.addini(_INI_LAUNCHER, HELP_LAUNCHER, default="")


def register_marker(config: pytest.Config) -> None:
    """Declare the marker so that ``--strict-markers`` accepts it."""
    config.addinivalue_line("markers", HELP_MARKER)


def validate_nproc(value: object, where: str) -> int:
    """A positive number of ranks; ``where`` names the option, ini key or marker argument."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None or number < 1:
        raise_for(where, f"expected a positive integer number of ranks, got {value!r}")
    assert number is not None
    return number


def validate_nproc_list(value: Sequence[object], where: str) -> tuple[int, ...]:
    """A marker's list of world sizes: non-empty, each a positive ``int``, each once.

    Stricter than :func:`validate_nproc` (no numeric strings): the list becomes test ids.
    """
    if not value:
        raise_for(where, "expected at least one number of ranks, got an empty list")
    sizes: list[int] = []
    for index, size in enumerate(value):
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            sizes.append(size)
            continue
        raise_for(
            where, f"expected positive integer numbers of ranks, got {size!r} at index {index}"
        )
    repeated = sorted({size for size in sizes if sizes.count(size) > 1})
    if repeated:
        listed = ", ".join(str(size) for size in repeated)
        raise_for(where, f"lists {listed} more than once; name each number of ranks once")
    return tuple(sizes)


def marker_nproc_list(mark: pytest.Mark) -> Sequence[object] | None:
    """The marker's ``nproc`` when it is a list or tuple (of world sizes), else ``None``."""
    raw = mark.kwargs.get("nproc", mark.args[0] if mark.args else None)
    return raw if isinstance(raw, list | tuple) else None


def over_cap(nproc: int, session: SessionSettings) -> str | None:
    """The skip reason of a test that needs ``nproc`` ranks, when that exceeds the cap."""
    if session.max_nproc is None or nproc <= session.max_nproc:
        return None
    return (
        f"fsdp2: needs {nproc} ranks, more than the cap of {session.max_nproc} set by "
        f"{session.max_nproc_from}; raise the cap to run it"
    )


def validate_backend(value: object, where: str) -> str:
    """One of ``auto``, ``gloo``, ``nccl``."""
    if isinstance(value, str) and value.strip().lower() in BACKENDS:
        return value.strip().lower()
    raise_for(where, f"expected one of {', '.join(BACKENDS)}, got {value!r}")
    raise AssertionError("unreachable")


def validate_timeout(value: object, where: str) -> float:
    """A finite, positive number of seconds."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = float(value.strip())
        except ValueError:
            seconds = None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise_for(where, f"expected a positive number of seconds, got {value!r}")
    assert seconds is not None
    return seconds


def validate_isolated(value: object, where: str) -> bool:
    """A real ``bool`` (a string such as ``"no"`` would silently read as true)."""
    if isinstance(value, bool):
        return value
    raise_for(where, f"expected True or False, got {value!r}")
    raise AssertionError("unreachable")


def raise_for(where: str, problem: str) -> None:
    """Raise the error that fits ``where``: a marker error for tests, else a usage error."""
    if where.startswith("@pytest.mark."):
        raise MarkerError(f"{where}: {problem}")
    raise pytest.UsageError(f"{where}: {problem}")


def timeout_words(seconds: float, where: str) -> str:
    """The timeout as a hang's report says it: ``--fsdp-timeout=5 s`` where an option set it,
    else the seconds and where they came from (``8 s (@pytest.mark.fsdp2(timeout=8))``)."""
    if where.startswith("-"):
        return f"{where} s"
    return f"{seconds:g} s ({where})"


def ini_value(config: pytest.Config, key: str) -> tuple[object, str] | None:
    """The ini key's value and where it came from: pytest's ``-o key=value`` (named as the
    user typed it, for it is not in any file), else the ini file; ``None`` where unset."""
    overrides = config.getoption("override_ini", None) or []
    for override in reversed(overrides):  # as in pytest: the last -o of a key wins
        name, _, value = str(override).partition("=")
        if name.strip() == key:
            return value, f"-o {key}={value}"
    ini = config.getini(key)
    if ini in ("", None):
        return None
    inipath = f" in {config.inipath}" if config.inipath else ""
    return ini, f"ini key '{key}'{inipath}"


def session_settings(config: pytest.Config) -> SessionSettings:
    """Resolve the session defaults: command line, else ini key, else built in.

    The cap (``--fsdp-max-nproc``) also has an environment variable, read between the two:
    a machine's limit (a CI runner's cores) overrides the project's ini file.

    Raises ``pytest.UsageError`` naming the option, variable or ini key of a bad value.
    """

    def pick(dest: str, option: str, env: str | None = None) -> tuple[object, str] | None:
        cli = config.getoption(dest)
        if cli is not None:
            return cli, f"{option}={cli}"
        if env is not None and os.environ.get(env, "").strip():
            return os.environ[env], f"environment variable {env}={os.environ[env]}"
        return ini_value(config, dest)

    nproc, backend, timeout = DEFAULT_NPROC, DEFAULT_BACKEND, DEFAULT_TIMEOUT_S
    timeout_from = SessionSettings.timeout_from
    if (raw := pick(_INI_NPROC, _OPTION_NPROC)) is not None:
        nproc = validate_nproc(*raw)
    if (raw := pick(_INI_BACKEND, _OPTION_BACKEND)) is not None:
        backend = validate_backend(*raw)
    if (raw := pick(_INI_TIMEOUT, _OPTION_TIMEOUT)) is not None:
        timeout = validate_timeout(*raw)
        timeout_from = timeout_words(timeout, raw[1])
    max_nproc, max_nproc_from = None, ""
    if (raw := pick(_INI_MAX_NPROC, _OPTION_MAX_NPROC, ENV_MAX_NPROC)) is not None:
        max_nproc, max_nproc_from = validate_nproc(*raw), raw[1]
    return SessionSettings(nproc, backend, timeout, max_nproc, max_nproc_from, timeout_from)


def validate_launcher(value: object, where: str) -> str:
    """One of ``auto``, ``local``, ``external``."""
    if isinstance(value, str) and value.strip().lower() in LAUNCHERS:
        return value.strip().lower()
    raise_for(where, f"expected one of {', '.join(LAUNCHERS)}, got {value!r}")
    raise AssertionError("unreachable")


def launcher_setting(config: pytest.Config) -> str:
    """``--fsdp-launcher``, else the ini key ``fsdp_launcher``, else ``auto``, validated.

    Raises ``pytest.UsageError`` naming the option or ini key of a bad value.
    """
    cli = config.getoption(_INI_LAUNCHER)
    if cli is not None:
        return validate_launcher(cli, f"{_OPTION_LAUNCHER}={cli}")
    ini = ini_value(config, _INI_LAUNCHER)
    return DEFAULT_LAUNCHER if ini is None else validate_launcher(*ini)


def is_marked(item: pytest.Item) -> bool:
    """Whether ``item`` carries ``@pytest.mark.fsdp2`` (on itself, its class or module)."""
    return item.get_closest_marker(MARKER_NAME) is not None


def item_settings(item: pytest.Item, session: SessionSettings) -> ItemSettings:
    """The closest ``fsdp2`` marker's arguments over the session defaults.

    Raises ``MarkerError`` naming the test and the marker argument of a bad value.
    """
    mark = item.get_closest_marker(MARKER_NAME)
    assert mark is not None, f"{item.nodeid} is not marked @pytest.mark.{MARKER_NAME}"
    kwargs = dict(mark.kwargs)
    where = f"@pytest.mark.{MARKER_NAME} on {item.nodeid}"
    if len(mark.args) > 1:
        raise MarkerError(f"{where}: takes at most one positional argument (nproc)")
    if mark.args:
        if "nproc" in kwargs:
            raise MarkerError(f"{where}: nproc given both positionally and as nproc=")
        kwargs["nproc"] = mark.args[0]
    unknown = sorted(set(kwargs) - {"nproc", "backend", "isolated", "timeout"})
    if unknown:
        raise MarkerError(
            f"{where}: unknown argument(s) {', '.join(unknown)}; "
            "the marker takes nproc, backend, isolated and timeout"
        )

    def arg_where(name: str) -> str:
        return f"@pytest.mark.{MARKER_NAME}({name}={kwargs[name]!r}) on {item.nodeid}"

    nproc = session.nproc
    if isinstance(kwargs.get("nproc"), list | tuple):  # one case per world size: this one's
        sizes = validate_nproc_list(kwargs["nproc"], arg_where("nproc"))
        nproc = _case_nproc(item, sizes, arg_where("nproc"))
    elif kwargs.get("nproc") is not None:
        nproc = validate_nproc(kwargs["nproc"], arg_where("nproc"))
    backend = session.backend
    if kwargs.get("backend") is not None:
        backend = validate_backend(kwargs["backend"], arg_where("backend"))
    isolated = False
    if "isolated" in kwargs:
        isolated = validate_isolated(kwargs["isolated"], arg_where("isolated"))
    timeout, timeout_from = session.timeout, session.timeout_from
    if kwargs.get("timeout") is not None:
        timeout = validate_timeout(kwargs["timeout"], arg_where("timeout"))
        timeout_from = timeout_words(
            timeout, f"@pytest.mark.{MARKER_NAME}(timeout={kwargs['timeout']!r})"
        )
    return ItemSettings(nproc, backend, isolated, timeout, timeout_from)


def _case_nproc(item: pytest.Item, sizes: tuple[int, ...], where: str) -> int:
    """The world size of ``item``, one case of a marker's list ``sizes``."""
    callspec = getattr(item, "callspec", None)
    size = callspec.params.get(WORLD_SIZE_PARAM) if callspec is not None else None
    if size not in sizes:
        # The list was not on the test when pytest collected it (item.add_marker later): it
        # was never expanded into one case per world size.
        raise MarkerError(
            f"{where}: a list of world sizes must be on the test when it is collected (as a "
            "decorator on the function, class or module), not added to it afterwards"
        )
    return int(size)


# --- what the ranks inherit from the parent's command line --------------------------------------

#: Options whose value the ranks need to see the same tests, fixtures and tracebacks.
_INHERITED_WITH_VALUE: Final = frozenset(
    {
        "-p",
        "-o",
        "--override-ini",
        "--import-mode",
        "-W",
        "--pythonwarnings",
        "--confcutdir",
        "--tb",
        "--assert",
        "--log-level",
        "--log-format",
        "--log-date-format",
    }
)
#: Flags with the same role. Everything else (selection, reporting, -x, -n, --lf, --junitxml,
#: --timeout, -s ...) belongs to the parent alone.
_INHERITED_FLAGS: Final = frozenset(
    {
        "--noconftest",
        "--runxfail",
        "-l",
        "--showlocals",
        "--full-trace",
        "--strict-markers",
        "--strict-config",
        "--strict",
    }
)
#: Short options whose value may be glued on (``-pNAME``).
_GLUED_SHORT: Final = frozenset({"-p", "-o", "-W"})
#: Ini keys the ranks set for themselves: an inherited override of ``addopts`` would bring the
#: parent's selection back, one of ``cache_dir`` would let the ranks overwrite its cache.
_RANK_OWNED: Final = frozenset({"addopts", "cache_dir"})


def _filter_inherited(args: list[str]) -> list[str]:
    kept: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg in _INHERITED_FLAGS:
            kept.append(arg)
            continue
        option: str | None = None
        value = ""
        if arg.startswith("--") and "=" in arg:
            option, value = arg.split("=", 1)
        elif arg in _INHERITED_WITH_VALUE and index < len(args):
            option, value = arg, args[index]
            index += 1
        elif arg[:2] in _GLUED_SHORT and len(arg) > 2 and not arg.startswith("--"):
            option, value = arg[:2], arg[2:]
        if option not in _INHERITED_WITH_VALUE:
            continue
        if option in ("-o", "--override-ini") and value.split("=", 1)[0].strip() in _RANK_OWNED:
            continue
        kept += [option, value]
    return kept


def rank_pytest_args(config: pytest.Config) -> list[str]:
    """The pytest arguments every rank of this session starts with (before its files).

    The parent's effective arguments are, in pytest's order, the ini ``addopts``, then
    ``PYTEST_ADDOPTS``, then the command line; the ranks inherit the allow-listed part of
    all three, with ``addopts`` cleared so nothing else comes back in. They also get the
    parent's rootdir and ini file, so node ids match, and a private cache folder.
    """
    effective = [
        *config.getini("addopts"),
        *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
        *config.invocation_params.args,
    ]
    args = ["-o", "addopts=", f"--rootdir={config.rootpath}"]
    if config.inipath is not None:
        args += ["-c", str(config.inipath)]
    return args + _filter_inherited([str(arg) for arg in effective])
