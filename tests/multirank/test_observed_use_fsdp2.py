"""Issue 22 in the ranks: layouts judged by observation (or a source scan through the MRO), and
gathered methods that nest, stay local when pure, and agree across ranks.

Each test body runs in the plugin's torchrun ranks (gloo on CPU, 2 ranks by default) on the toys
of tests/core/observed_toys.py, sharded by ``fp32keep.apply_fsdp2`` from the source (no
inputs; reads only), from an observed forward and from ``example_inputs``. Each has its
negative control: the layout or registration the library made before, sharded by hand, fails
the same way.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep._torch import fsdp_hooks
from fp32keep.shard.apply import kept_unit_policy
from fp32keep.shard.gathered import register_gathered_methods
from tests.core.observed_toys import HelperStack, InheritedReadStack, NestedCallsStack
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank

pytestmark = pytest.mark.fsdp2

BF16, FP32 = torch.bfloat16, torch.float32
SEMANTICS = "5.10.4"
POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)
HOW = pytest.mark.parametrize("how", ["source", "observed", "example"])
#: Which methods run a unit's parameters only a run shows: the source fallback gathers none.
RUN = pytest.mark.parametrize("how", ["observed", "example"])

refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def ids() -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(7))


def built(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module, fp32keep.KeepPlan]:
    """A keep-aware cast model, its unsharded reference, and the plan."""
    torch.manual_seed(0)
    model = cls()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, copy.deepcopy(model), plan


def observed(model: nn.Module) -> fp32keep.ParameterUse:
    with fp32keep.observe_parameter_use(model) as use:
        model(ids())
    return use


def observed_on_rank_zero(model: nn.Module) -> fp32keep.ParameterUse:
    """Rank 0's forward observed; on the other ranks an observation in which nothing ran."""
    if dist.get_rank() == 0:
        return observed(model)
    with fp32keep.observe_parameter_use(model) as use:
        pass
    return use


def sharded(cls: type[nn.Module], how: str, mesh: DeviceMesh) -> tuple[nn.Module, nn.Module]:
    """``cls`` sharded by apply_fsdp2 from the source, from an observed forward, or from
    ``example_inputs`` (apply_fsdp2 observes), and its unsharded reference."""
    model, reference, plan = built(cls)
    use = observed(model) if how == "observed" else None
    example = (ids(),) if how == "example" else None
    fp32keep.apply_fsdp2(
        model, mesh=mesh, mp_policy=POLICY, plan=plan, observed=use, example_inputs=example
    )
    return model, reference


def step(model: nn.Module) -> torch.Tensor:
    logits = model(ids())
    logits.float().logsumexp(-1).mean().backward()
    return logits


def assert_same_run(model: nn.Module, reference: nn.Module) -> None:
    """Logits and every gradient of the sharded ``model`` bit-identical to ``reference``'s."""
    assert torch.equal(step(model), step(reference))
    want = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            got = grad.full_tensor() if isinstance(grad, DTensor) else grad
            assert torch.equal(got, want.pop(name)), name
    assert not want, f"no gradient for {sorted(want)}"


def gathers_of(module: nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the all-gathers a gathered method starts on ``module``'s unit: the calls of the
    library's one entry to the unit's forward pre-hook (FSDP2's own forward hook, bound at
    fully_shard, is not counted)."""
    count = [0]
    pre_forward = fsdp_hooks.unit_pre_forward

    def counted(unit: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += unit is module
        return pre_forward(unit, *args, **kwargs)

    monkeypatch.setattr(fsdp_hooks, "unit_pre_forward", counted)
    return count


# --- item 1: a read inside an inherited forward ----------------------------------------------


@HOW
def test_a_read_in_an_inherited_forward_is_replicated_and_runs(how: str, mesh: DeviceMesh) -> None:
    model, reference = sharded(InheritedReadStack, how, mesh)
    positions = model.encoder.embed_positions.weight
    assert not isinstance(positions, DTensor) and positions.dtype == FP32
    assert_same_run(model, reference)


def test_negative_control_the_inherited_read_as_its_own_unit_crashes(mesh: DeviceMesh) -> None:
    # The layout the one-class scan gave: the read module a kept unit never all-gathered.
    model, _, _ = built(InheritedReadStack)
    fully_shard(model.encoder.embed_positions, mesh=mesh, mp_policy=kept_unit_policy(POLICY))
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=POLICY)
    fully_shard(model, mesh=mesh, mp_policy=POLICY)
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"):
        step(model)


# --- item 2a: nested gathered calls gather once ----------------------------------------------


@RUN
def test_nested_gathered_calls_gather_once_and_match_the_unsharded_model(
    how: str, mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    # forward calls encode, encode calls quantize, roundtrip calls the codec: each goes on
    # using the codec's parameters after the inner call returns.
    model, reference = sharded(NestedCallsStack, how, mesh)
    assert isinstance(model.codec.scale, DTensor)  # sharded at rest
    gathers = gathers_of(model.codec, monkeypatch)
    assert_same_run(model, reference)
    assert gathers == [3]  # the parent's encode, quantize and roundtrip; nothing nested


def test_negative_control_torchs_registration_reshards_mid_call(mesh: DeviceMesh) -> None:
    # The same units, the methods registered with torch's own wrapper (what apply_fsdp2 did):
    # the inner call's post-forward reshards the codec under the outer one.
    model, _, _ = built(NestedCallsStack)
    fully_shard(model.codec, mesh=mesh, mp_policy=kept_unit_policy(POLICY))
    fully_shard(model.block, mesh=mesh, mp_policy=POLICY)
    fully_shard(model, mesh=mesh, mp_policy=POLICY)
    for method in ("encode", "quantize", "roundtrip"):
        register_fsdp_forward_method(model.codec, method)
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"):
        step(model)


# --- item 2b/2c: only methods that use parameters are collectives ------------------------------


@RUN
def test_a_pure_helper_is_not_gathered_and_runs_on_one_rank_alone(
    how: str, mesh: DeviceMesh
) -> None:
    # Kyutai's shape: get_encoded_length is arithmetic on the conv's stride.
    model, reference = sharded(HelperStack, how, mesh)
    assert "encode" in vars(model.codec)  # gathered: it runs the conv
    assert "get_encoded_length" not in vars(model.codec)
    assert_same_run(model, reference)
    if dist.get_rank() == 0:  # no collective: rank 1 is not needed (a gathered one would hang)
        assert model.codec.get_encoded_length(9) == 4


def test_from_the_source_no_method_is_gathered_and_the_warning_says_why(mesh: DeviceMesh) -> None:
    # Without inputs the source cannot tell encode (runs the conv) from the pure helper: neither
    # is gathered, the warning names both and the fix, and encode then meets sharded weights.
    model, _, plan = built(HelperStack)
    with pytest.warns(fp32keep.SourceFallbackWarning, match=r"self\.codec\.encode\(\.\.\.\)"):
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, plan=plan)
    assert "encode" not in vars(model.codec)
    with pytest.raises(Exception, match=r"DTensor"):
        step(model)


def test_negative_control_a_gathered_helper_is_a_collective(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Registered (as the old scan did), the same helper all-gathers the codec on every call,
    # so a call on one rank alone would wait for the other.
    model, _, plan = built(HelperStack)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, plan=plan, observed=observed(model))
    register_gathered_methods(model, [("codec",)], {"codec": ("get_encoded_length",)})
    gathers = gathers_of(model.codec, monkeypatch)
    assert model.codec.get_encoded_length(9) == 4
    assert gathers == [1]


def test_observations_that_differ_between_ranks_are_merged(mesh: DeviceMesh) -> None:
    # Rank 1's forward did not run the codec (a batch without that input): every rank must
    # still lay out the same units, or their collectives would not pair.
    model, reference, plan = built(NestedCallsStack)
    use = observed_on_rank_zero(model)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, plan=plan, observed=use)
    assert {"encode", "quantize", "roundtrip"} <= set(vars(model.codec))
    assert_same_run(model, reference)


def test_negative_control_unmerged_observations_give_ranks_other_layouts(mesh: DeviceMesh) -> None:
    model, _, plan = built(NestedCallsStack)
    use = observed_on_rank_zero(model)
    own = dict(fp32keep.plan_layout(model, plan, observed=use).forward_methods)
    layouts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, own)
    assert layouts == [{"codec": ("encode", "quantize", "roundtrip")}, {}]


# --- refusals --------------------------------------------------------------------------------


def _apply_with(
    observation: Callable[[nn.Module], object], mesh: DeviceMesh
) -> Callable[[], object]:
    model, _, plan = built(NestedCallsStack)
    use: Any = observation(model)
    return lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, plan=plan, observed=use)


def test_an_observation_of_another_model_or_type_is_refused_on_every_rank(
    mesh: DeviceMesh,
) -> None:
    refused_on_every_rank(
        _apply_with(lambda model: {"codec": ["encode"]}, mesh),
        TypeError,
        "observed must be a fp32keep.ParameterUse, got dict",
    )
    other, _, _ = built(HelperStack)
    error = refused_on_every_rank(
        _apply_with(lambda m: observed(other) if dist.get_rank() == 1 else observed(m), mesh),
        ValueError,
        "rank 1: the observation is of HelperStack",
    )
    assert "observe the model you shard, before sharding it" in str(error)


def test_an_observation_still_recording_is_refused_on_every_rank(mesh: DeviceMesh) -> None:
    def recording(model: nn.Module) -> object:
        with fp32keep.observe_parameter_use(model) as use:
            fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, observed=use)
        return None  # pragma: no cover - apply_fsdp2 raised

    model, _, _ = built(NestedCallsStack)
    refused_on_every_rank(
        lambda: recording(model), ValueError, "observed is still recording: pass it after"
    )
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing sharded
