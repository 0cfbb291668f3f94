"""The control shards the implementation's units in an order that reproduces them (pure)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep
from pytest_fp32keep.contract.control import Unit, sharding_order
from pytest_fp32keep.contract.policy import correct_policy
from tests.core.toys import stack_class


def unit(*modules: str, params: tuple[str, ...] = ("x",)) -> Unit:
    return Unit(tuple(modules), frozenset(params))


def test_inner_units_come_first_even_when_a_grouped_unit_reaches_shallower() -> None:
    # Afmoe's model-wide kept unit: norms at depth 3 and 4, plus `model.norm` at depth 1, so
    # "deepest first" by its shallowest module would shard `model.layers.0` before it.
    root, block = unit(""), unit("model.layers.0")
    grouped = unit(
        "model.layers.0.self_attn.q_norm", "model.layers.0.input_layernorm", "model.norm"
    )
    router = unit("model.layers.0.mlp.router")
    order = sharding_order((root, block, grouped, router))
    assert order.index(grouped) < order.index(block) < order.index(root)
    assert order.index(router) < order.index(block)
    assert not block.inside(unit("model.layers.0"))  # the same module is not inside itself
    assert not unit("model.layers.10").inside(block)  # a prefix of the name is not a parent


def test_units_that_nest_both_ways_are_refused() -> None:
    a, b = unit("a", "b.c"), unit("b", "a.c")
    with pytest.raises(RuntimeError, match="nest in a cycle"):
        sharding_order((a, b))


def test_correct_policy_keeps_fp32_math_in_fully_kept_units_only() -> None:
    model = stack_class(strict=["wo"])()
    plan = fp32keep.resolve_keep_plan(model, torch.bfloat16)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
    )
    kept = correct_policy(unit("layers.0.wo", params=("layers.0.wo.weight",)).params, plan, policy)
    assert (kept.param_dtype, kept.reduce_dtype, kept.output_dtype) == (None, None, None)
    assert kept.cast_forward_inputs == policy.cast_forward_inputs
    mixed = unit("layers.0", params=("layers.0.wo.weight", "layers.0.attn.weight"))
    assert correct_policy(mixed.params, plan, policy) is policy
    fp32_reduce = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    wo = unit("layers.1.wo", params=("layers.1.wo.weight",))
    assert correct_policy(wo.params, plan, fp32_reduce).reduce_dtype == torch.float32
