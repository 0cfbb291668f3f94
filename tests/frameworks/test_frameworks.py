"""Every framework's FSDP2 path under the contract, on zoo models, in 2 ranks.

The setups live in ``tests/frameworks/cases/`` (one module per framework). Each case asserts
exactly the set of failing rows observed (``observe.rows_of``), so a fix or a new regression in a
framework changes the set and fails here; ``nox -s frameworks`` then renders the recorded sets,
with their causes, into ``docs/frameworks.md``.
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest
from torch.distributed.device_mesh import DeviceMesh

from pytest_fp32keep.check.arguments import build_parser
from pytest_fp32keep.check.plugins import Plugins, resolve_plugins
from tests.frameworks.cases import (
    accelerate,
    axolotl,
    fp32keep_control,
    nemo_automodel,
    torchtitan,
    transformers,
    trl,
    verl,
)
from tests.frameworks.harness import DTYPES, MODELS, Setup, Source
from tests.frameworks.observe import observe, record

pytestmark = pytest.mark.slow  # breadth at pinned versions (conftest.py)

MODULES = (
    fp32keep_control,
    accelerate,
    transformers,
    verl,
    trl,
    axolotl,
    nemo_automodel,
    torchtitan,
)
"""The framework case modules run here, each a tuple ``SETUPS``."""

SETUPS: dict[str, Setup] = {setup.name: setup for module in MODULES for setup in module.SETUPS}
CASES = [(setup, model) for setup in SETUPS for model in SETUPS[setup].expected]


@pytest.mark.fsdp2(nproc=2)
@pytest.mark.parametrize(("setup", "model"), CASES)
def test_framework_fails_exactly_the_recorded_rows(
    fsdp2_mesh: DeviceMesh, fsdp2_rank: int, setup: str, model: str
) -> None:
    chosen = SETUPS[setup]
    dtype = MODELS[model]
    outcome = observe(lambda: chosen.run(fsdp2_mesh, model, DTYPES[dtype]))
    if fsdp2_rank == 0:
        record(chosen, model, dtype, outcome)
    assert outcome.rows == chosen.expected[model], outcome.crash or "\n".join(outcome.examples)


def _installed(path: str) -> Path:
    """``path`` (``accelerate/utils/fsdp_utils.py``) in the installed distribution."""
    spec = importlib.util.find_spec(path.split("/")[0])
    assert spec is not None and spec.submodule_search_locations, f"{path}: not installed"
    return Path(next(iter(spec.submodule_search_locations))).parent / path


SOURCES = sorted(
    {s for setup in SETUPS.values() for cause in setup.causes.values() for s in cause.sources},
    key=str,
)


@pytest.mark.parametrize("source", SOURCES, ids=[f"{s.path}:{s.line}" for s in SOURCES])
def test_cited_source_line_holds_what_the_cause_says(source: Source) -> None:
    """Each cited line holds the cited text at the installed (pinned) version."""
    lines = _installed(source.path).read_text(encoding="utf-8").splitlines()
    assert source.line <= len(lines), f"{source.path} has {len(lines)} lines"
    found = [n for n, text in enumerate(lines, 1) if source.shows in text]
    assert source.shows in lines[source.line - 1], (
        f"{source.path}:{source.line} is {lines[source.line - 1].strip()!r}; "
        f"the cited text is on line(s) {found}"
    )


@pytest.mark.parametrize(("setup", "model"), CASES)
def test_reproducer_is_a_command_fp32keep_check_runs(setup: str, model: str) -> None:
    """The table's one-line reproducer parses as ``fp32keep check`` options and every function
    it plugs in imports and has the signature the contract calls (what the command checks
    before it starts a rank)."""
    command = shlex.split(SETUPS[setup].reproducer(model))
    assert command[:2] == ["fp32keep", "check"], command
    args = build_parser().parse_args(command[1:])
    assert args.targets == [model] and len(args.dtype) == 1
    resolve_plugins(Plugins.from_args(args), [DTYPES[MODELS[model]]])
