"""A parameter of a unit fp32keep makes, used by code outside that unit, in the ranks (issue 23).

The root owns only a kept ``query_tokens`` (Blip2's shape), so each of its children is a unit
of its own; the root computes its logits from ``self.decoder.head.weight``, a bf16 weight inside
the ``decoder`` unit (:class:`tests.core.read_toys.HeadReadingRoot`). Sharded as the layout did
before the check (the negative control, by hand with ``fully_shard``), the first forward fails
with ``mixed torch.Tensor and DTensor``; ``apply_fsdp2`` now refuses it on every rank before
sharding anything. A root that calls its child (the positive control) keeps the whole contract,
and with the tokens frozen the read weight stays in the root's unit and the model runs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import KeepLayoutError, KeepPlan
from fp32keep.shard.apply import kept_unit_policy
from pytest_fp32keep import assert_fp32_keep_contract
from tests.core.read_toys import (
    ChildCallingRoot,
    HeadReadingRoot,
    InspectingRoot,
    ProjReadingStack,
)
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import assert_unchanged, snapshot

pytestmark = pytest.mark.fsdp2

BF16, FP32 = torch.bfloat16, torch.float32
SEMANTICS = "5.10.4"
EXACT_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)

refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def ids() -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(7))


def built(cls: type[nn.Module]) -> tuple[nn.Module, KeepPlan]:
    torch.manual_seed(0)
    model = cls()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, plan


def step(model: nn.Module) -> torch.Tensor:
    logits = model(ids())
    logits.float().logsumexp(-1).mean().backward()
    return logits


def shard_as_before(model: nn.Module, mesh: DeviceMesh) -> None:
    """The units the layout chose for HeadReadingRoot before the check, in its order: blocks,
    the kept Q-Former, every child of the root, then the root as an FP32 unit."""
    kept = kept_unit_policy(EXACT_POLICY)
    for layer in model.qformer.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=kept)
    for layer in model.decoder.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model.qformer, mesh=mesh, mp_policy=kept)
    fully_shard(model.embed, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model.decoder, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=kept)


def test_negative_control_the_layout_before_the_check_crashes_at_the_first_forward(
    mesh: DeviceMesh,
) -> None:
    model, _ = built(HeadReadingRoot)
    shard_as_before(model, mesh)
    with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"):
        step(model)


ROOT_READ = (HeadReadingRoot, ["decoder.head.weight"])
OWNER_READ = (ProjReadingStack, [f"layers.{i}.self_attn.o_proj.weight" for i in (0, 1)])


@pytest.mark.parametrize(
    ("cls", "refused", "observed"),
    [(*ROOT_READ, False), (*ROOT_READ, True), (*OWNER_READ, False), (*OWNER_READ, True)],
    ids=["root-source", "root-observed", "owner-source", "owner-observed"],
)
def test_a_unit_read_from_outside_is_refused_on_every_rank(
    mesh: DeviceMesh, cls: type[nn.Module], refused: list[str], observed: bool
) -> None:
    model, plan = built(cls)
    use = None
    if observed:
        with fp32keep.observe_parameter_use(model) as use:
            model(ids())
    before = snapshot(model)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(
            model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan, observed=use
        ),
        KeepLayoutError,
        "nothing was sharded",
    )
    assert [(p.fqn, p.reason) for p in error.problems] == [
        (name, "read-not-called") for name in refused
    ]
    assert_unchanged(model, before)


@pytest.mark.parametrize("cls", [ChildCallingRoot, InspectingRoot])
def test_a_root_that_calls_its_child_keeps_the_whole_contract(
    mesh: DeviceMesh, cls: type[nn.Module]
) -> None:
    # InspectingRoot also looks at a weight inside the decoder's unit (isinstance, .dtype),
    # which the check lets through: the sharded parameter answers both.
    report = assert_fp32_keep_contract(
        cls, lambda model: ids(), mesh=mesh, dtype=BF16, autocast=True, mp_policy=EXACT_POLICY
    )
    rows = {row.fqn: row for row in report.kept}
    assert (rows["query_tokens"].stored, rows["query_tokens"].materialized) == ("float32",) * 2
    assert report.ok, report.table(failures_only=True)


def test_frozen_tokens_leave_the_read_weight_in_the_root_unit_and_it_runs(
    mesh: DeviceMesh,
) -> None:
    model, _ = built(HeadReadingRoot)
    model.query_tokens.requires_grad_(False)
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    reference = copy.deepcopy(model)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    assert torch.equal(step(model), step(reference))
