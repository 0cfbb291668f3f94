"""A gathered method is a collective: called on one rank alone, it never hangs silently.

``fp32keep.apply_fsdp2`` registers the methods other than ``forward`` that a forward on its
``example_inputs`` is observed to run a unit's parameters through (a tokenizer's ``encode``) so
that FSDP2 all-gathers the unit around them; like
``forward``, such a method must then run on every rank. A real inner session calls one on rank 0
alone: the runner reports the rank stuck in the all-gather within seconds (docs/errors.md), with
its stack, and the next test passes on fresh ranks. Negative control: the pure helper beside it
(no parameter used) is not gathered and runs on rank 0 alone. Breadth over the default tier's
runner-fault rows, so ``slow``.
"""

from __future__ import annotations

import pytest

from tests.error_bounds import RANK_FAULT_BOUND_S, note_elapsed
from tests.plugin._inner import WALL_CLOCK_CONFTEST, InnerProject, failure_section

pytestmark = pytest.mark.slow

INNER_TESTS = """
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep

pytestmark = pytest.mark.fsdp2


class Tokenizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def frames(self, samples):
        return samples // 2  # arithmetic only: never gathered

    def encode(self, x):
        return self.proj(x.to(self.proj.weight.dtype)).to(x.dtype)

    def forward(self, x):
        return self.encode(x)


class Model(nn.Module):
    _keep_in_fp32_modules_strict = ["tokenizer"]

    def __init__(self):
        super().__init__()
        self.tokenizer = Tokenizer()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.tokenizer.encode(x)[:, : self.tokenizer.frames(8)])


def sharded(mesh):
    model = Model()
    fp32keep.keep_aware_cast(model, torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    example = (torch.ones(2, 4, dtype=torch.bfloat16),)  # observed: encode runs the proj
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, example_inputs=example)
    return model


def test_pure_helper_on_one_rank(fsdp2_mesh, fsdp2_rank):
    model = sharded(fsdp2_mesh)
    assert "frames" not in vars(model.tokenizer)
    if fsdp2_rank == 0:
        assert model.tokenizer.frames(8) == 4


def test_gathered_encode_on_one_rank(fsdp2_mesh, fsdp2_rank):
    model = sharded(fsdp2_mesh)
    assert "encode" in vars(model.tokenizer)
    if fsdp2_rank == 0:  # rank 1 never joins the all-gather
        model.tokenizer.encode(torch.ones(1, 4, dtype=torch.bfloat16))


def test_ok_after(fsdp2_mesh):
    model = sharded(fsdp2_mesh)
    assert model(torch.ones(2, 4, dtype=torch.bfloat16)).shape == (2, 4)
"""


def test_a_gathered_method_on_one_rank_is_reported_within_seconds(inner: InnerProject) -> None:
    inner.write(test_gathered=INNER_TESTS, conftest=WALL_CLOCK_CONFTEST)
    result = inner.run("-rA")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines_random(
        [
            "PASSED test_gathered.py::test_pure_helper_on_one_rank",
            "PASSED test_gathered.py::test_ok_after",
        ]
    )
    text = failure_section(result.stdout.str(), "test_gathered_encode_on_one_rank")
    assert "no rank failed by itself: stuck after rank 1 finished" in text
    assert "did not finish within 3 s after rank 1 finished" in text
    assert "all_gather" in text and "in test_gathered_encode_on_one_rank" in text  # its stack
    wall = inner.wall_times()["test_gathered.py::test_gathered_encode_on_one_rank"]
    assert wall < RANK_FAULT_BOUND_S, f"reported after {wall:.1f} s"
    note_elapsed(wall)
