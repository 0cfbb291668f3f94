"""A keep plan that differs between ranks is an error on every rank, where ranks already meet.

The plan observes what the model code builds in FP32 by rebuilding the class on the meta device
(:mod:`fp32keep.plan.constructed`). A rebuild that fails on one rank only (a file, memory or an
import of that rank's own: ``OSError`` here) fails open there: that rank's plan misses the
constructed tensors the others keep, and the ranks would cast and shard different dtypes. Where the
ranks already exchange something before anything is cast or sharded (``apply_fsdp2(observed=...)``,
the contract's ``build`` step) the plans' digests are compared: every rank raises, naming the rank
and its failure. Before, both calls went on with the divergent plans (the negative control is the
old code: neither raised).
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep.plan import constructed
from pytest_fp32keep import assert_fp32_keep_contract
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank

transformers = pytest.importorskip("transformers")
from tests.test_plan_constructed import ToyConfig  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.fsdp2

BF16, FP32 = torch.bfloat16, torch.float32
POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)
#: What rank 1's rebuild raises: an error of its own environment (constructed.LOCAL_ERRORS).
FULL_DISK = "[Errno 28] No space left on device"
DIVERGED = (
    r"the keep plan on ranks \[1\] differs from rank 0's; construction not observed on rank 1: "
    r"RunningToy: rebuild from its config failed \(OSError: \[Errno 28\]"
)

refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


class Gate(nn.Module):
    """Builds its parameter and persistent buffer in FP32, in no keep list (as EsmFold2 does)."""

    scale: torch.Tensor

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.log_delta = nn.Parameter(torch.zeros(hidden, dtype=torch.float32))
        self.register_buffer("scale", torch.ones(hidden, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * (self.log_delta.exp() * self.scale).to(hidden.dtype)


class RunningToy(transformers.PreTrainedModel):  # type: ignore[misc,name-defined]
    """A Transformers model whose code builds ``gate``'s tensors in FP32: the plan keeps them
    when its rebuild on the meta device works."""

    config_class = ToyConfig
    base_model_prefix = "toy"

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.gate = Gate(config.hidden)
        self.head = nn.Linear(config.hidden, 2)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.proj(x)))  # type: ignore[no-any-return]


def running_toy() -> nn.Module:
    torch.manual_seed(0)
    return RunningToy(ToyConfig())


def batch(model: nn.Module) -> dict[str, torch.Tensor]:
    """Inputs in the dtype of the model's projection (as a processor's ``.to(model.dtype)``)."""
    x = torch.randn((2, 8), generator=torch.Generator().manual_seed(0))
    return {"x": x.to(next(model.parameters()).dtype)}  # proj.weight's


@pytest.fixture
def full_disk_on_rank_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's rebuild raises ``OSError``; the other ranks' rebuild as usual."""
    constructed.clear_cache()
    if dist.get_rank() != 1:
        return

    def full(*_: Any) -> NoReturn:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(constructed, "_observe", full)


def test_apply_fsdp2_refuses_plans_that_differ_between_ranks_on_every_rank(
    mesh: DeviceMesh, full_disk_on_rank_1: None
) -> None:
    model = running_toy()
    plan = fp32keep.resolve_keep_plan(model, BF16)
    assert bool(plan.unobserved) == (dist.get_rank() == 1)
    with fp32keep.observe_parameter_use(model) as use:
        model(**batch(model))
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, plan=plan, observed=use),
        ValueError,
        "apply_fsdp2: " + DIVERGED,
    )
    assert FULL_DISK in str(error)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing sharded


def test_the_contract_refuses_plans_that_differ_between_ranks_on_every_rank(
    mesh: DeviceMesh, full_disk_on_rank_1: None
) -> None:
    refused_on_every_rank(
        lambda: assert_fp32_keep_contract(running_toy, batch, mesh=mesh, dtype=BF16),
        ValueError,
        "assert_fp32_keep_contract: " + DIVERGED,
    )


def test_plans_that_agree_pass_both(mesh: DeviceMesh) -> None:
    """The control: with every rank's rebuild working, both go on (the contract passes)."""
    constructed.clear_cache()
    report = assert_fp32_keep_contract(running_toy, batch, mesh=mesh, dtype=BF16)
    assert {row.fqn for row in report.kept} == {"gate.log_delta", "gate.scale"}
