"""What every framework case shares: the zoo models, one setup's shape, the contract call.

A framework's cases live in ``tests/frameworks/cases/<framework>.py`` as a tuple ``SETUPS`` of
:class:`Setup`: how to run the contract with the framework's code plugged in, the exact failing
rows expected on each model at the pinned versions, and for each failing model the :class:`Cause`
(why, where in the framework's source, a one-line reproducer), which ``docs/frameworks.md``
prints beside the rows so that each could be filed upstream as it stands.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from pytest_fp32keep import ContractReport, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = {"t5": "fp16", "ernie4_5_moe": "bf16", "deepseek_v3": "bf16", "gpt_oss": "fp16"}
"""Zoo model -> the dtype it keeps something under (regular lists: fp16 only); T5 ties three
embeddings, Ernie4.5-MoE keeps its router (strict list) and ties two, DeepSeek-V3 keeps a router
weight and a router buffer, GptOss keeps every norm (regular list)."""

ADAPTERS = "examples.frameworks"
"""The package of the adapters, as ``fp32keep check`` imports them from the repository root."""

Run = Callable[[DeviceMesh, str, torch.dtype], ContractReport]


@dataclasses.dataclass(frozen=True)
class Source:
    """One line of a framework's code at the pinned version, and what it does to the keep.

    ``shows`` is text that line holds there: ``tests/frameworks`` checks it against the installed
    distribution, so a citation that moves with a new release fails instead of misleading.
    """

    path: str  # inside site-packages: "accelerate/utils/fsdp_utils.py"
    line: int
    shows: str
    what: str

    def __str__(self) -> str:
        return f"`{self.path}:{self.line}` ({self.what})"


@dataclasses.dataclass(frozen=True)
class Cause:
    """Why a framework fails a model as it does, written to be filed upstream as it stands:
    the mechanism, and where in the framework's source it happens."""

    why: str
    sources: tuple[Source, ...]

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError(f"a Cause cites the framework's source: {self.why[:60]!r}...")

    @property
    def where(self) -> str:
        return "; ".join(map(str, self.sources))


@dataclasses.dataclass(frozen=True)
class Setup:
    """One framework configured one way, and what it fails on each model."""

    name: str
    dist: str  # the distribution whose version the table shows
    description: str
    run: Run
    expected: Mapping[str, frozenset[str]]  # model -> the failing rows (empty: it passes)
    causes: Mapping[str, Cause] = dataclasses.field(default_factory=dict)
    check_options: str = ""
    """The ``fp32keep check`` options that plug the same code in (``--shard MODULE:FUNCTION``
    ...), from which :meth:`reproducer` writes the one line that shows a row from a checkout."""

    def reproducer(self, model: str) -> str:
        """One command, run at the repository root, that checks ``model`` as this setup does."""
        options = f" {self.check_options}" if self.check_options else ""
        return f"fp32keep check {model} --dtype {MODELS[model]}{options}"

    def __post_init__(self) -> None:
        if unknown := set(self.expected) - set(MODELS):
            raise ValueError(f"setup {self.name!r}: expected rows for unknown models {unknown}")
        if silent := {m for m, rows in self.expected.items() if rows} - set(self.causes):
            raise ValueError(f"setup {self.name!r}: failing models without a Cause: {silent}")


def passes_everywhere() -> dict[str, frozenset[str]]:
    """The expectation of a correct path: no failing row on any model."""
    return {model: frozenset() for model in MODELS}


def on_zoo(mesh: DeviceMesh, model: str, dtype: torch.dtype, **plugged: Any) -> ContractReport:
    """The contract on zoo ``model`` at ``dtype``, forward under autocast, with ``plugged``
    (``cast=``, ``shard=``, ``load=``, ``mp_policy=`` ...) in place of its defaults."""
    entry = ZOO[model]
    return assert_fp32_keep_contract(
        entry.build,
        functools.partial(entry.make_batch, seed=0),
        mesh=mesh,
        dtype=dtype,
        autocast=True,
        **plugged,
    )
