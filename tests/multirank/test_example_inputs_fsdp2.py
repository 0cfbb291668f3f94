"""``apply_fsdp2(example_inputs=...)`` in the ranks: one observed forward, one layout (issue 35).

Each test body runs in the plugin's torchrun ranks (gloo on CPU, 2 ranks). The model is
:class:`tests.core.observed_toys.NestedCallsStack` (a kept codec its parent runs through
``encode``, ``quantize`` and ``roundtrip``: only a run shows those, the source fallback gathers
none). Negative controls: each rank laying out on its own gives the ranks different layouts;
the same calls with good inputs raise nothing.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from tests.core.observed_toys import NestedCallsStack
from tests.core.test_source_fallback import CommentedStack
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank

pytestmark = pytest.mark.fsdp2

BF16, FP32 = torch.bfloat16, torch.float32
SEMANTICS = "5.10.4"
POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)
METHODS = {"codec": ("encode", "quantize", "roundtrip")}

refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def ids(high: int = 16) -> torch.Tensor:
    return torch.randint(0, high, (2, 6), generator=torch.Generator().manual_seed(7))


def built(cls: type[nn.Module] = NestedCallsStack, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = cls()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model


def every_rank(value: object) -> list[Any]:
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


def layout_facts(model: nn.Module) -> tuple[Any, ...]:
    layout = fp32keep.sharded_layout(model)
    assert layout is not None
    units = [(unit.kind, unit.module_fqns) for unit in layout.units]
    return units, dict(layout.forward_methods), layout.replicated


def test_inputs_run_on_rank_zero_with_the_others_on_meta_give_every_rank_one_layout(
    mesh: DeviceMesh,
) -> None:
    # The launch pattern "rank 0 real, the rest on meta": rank 0 observes; the meta ranks' inputs
    # (ids no embedding has: run, they would raise) are never run.
    source = dist.get_rank() == 0
    model = built(meta=not source)
    reference = copy.deepcopy(model) if source else None
    inputs = (ids(),) if source else (ids(high=1000),)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, example_inputs=inputs)
    facts = every_rank(layout_facts(model))
    assert facts[0] == facts[1], facts
    assert facts[0][1] == METHODS  # what rank 0's forward ran, on every rank
    # The model runs sharded once rank 0's weights are loaded, as rank 0's reference does.
    fp32keep.load_full_state_dict(model, reference.state_dict() if reference else None)
    logits = model(ids())
    logits.float().logsumexp(-1).mean().backward()
    if reference is not None:
        assert torch.equal(logits, reference(ids()))
    # Negative control: each rank laying out on its own (rank 1 from the source of a meta
    # model) gives the ranks different gathered methods, so their collectives would not pair.
    alone = built(meta=not source)
    plan = fp32keep.resolve_keep_plan(alone, BF16, transformers_version=SEMANTICS)
    own: Any = None
    if source:
        with fp32keep.observe_parameter_use(alone) as own:
            alone(ids())
    assert every_rank(dict(fp32keep.plan_layout(alone, plan, observed=own).forward_methods)) == [
        METHODS,
        {},
    ]


def test_a_forward_raising_on_one_rank_raises_on_every_rank_naming_it(mesh: DeviceMesh) -> None:
    model = built()
    bad = (ids(high=1000),) if dist.get_rank() == 1 else (ids(),)  # ids the embedding lacks
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, example_inputs=bad),
        ValueError,
        r"apply_fsdp2\(example_inputs=\.\.\.\): rank 1: the example forward of NestedCallsStack "
        r"raised IndexError",
    )
    assert "rank 0" not in str(error)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing sharded
    # Negative control: the same call with good inputs on every rank shards.
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, example_inputs={"ids": ids()})
    assert isinstance(model.codec.scale, DTensor)


def test_unusable_example_inputs_are_refused_on_every_rank(mesh: DeviceMesh) -> None:
    model = built()
    refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, example_inputs=ids()),  # type: ignore[arg-type]
        TypeError,
        r"example_inputs must be a mapping of forward keyword arguments .* got Tensor",
    )
    with fp32keep.observe_parameter_use(model) as use:
        model(ids())
    refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(
            model, mesh=mesh, mp_policy=POLICY, example_inputs=(ids(),), observed=use
        ),
        ValueError,
        r"pass example_inputs= .* or observed= .*, not both",
    )
    on_meta = built(meta=True)
    refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(on_meta, mesh=mesh, mp_policy=POLICY, example_inputs=(ids(),)),
        ValueError,
        "every rank's model has tensors on the meta device, so no rank can run the example",
    )
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing sharded


def test_the_commented_reader_lays_out_on_the_default_path_and_runs(mesh: DeviceMesh) -> None:
    # No inputs: the source fallback. A comment naming embed_positions.weight is no read, so
    # the called module is a unit of its own, gathered by its hooks; nothing to warn about.
    model = built(CommentedStack)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp32keep.SourceFallbackWarning)
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY)
    assert isinstance(model.encoder.embed_positions.weight, DTensor)
    assert torch.equal(model(ids()), reference(ids()))
