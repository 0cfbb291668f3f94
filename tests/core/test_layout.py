"""The FSDP2 unit layout and every fail-closed reason, decided without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp32keep import KeepLayoutError, KeepPlan, keep_aware_cast, plan_layout, resolve_keep_plan
from fp32keep.layout.units import Layout
from tests.core.toys import Block, Stack, stack_class

BF16, FP32 = torch.bfloat16, torch.float32
# Layout decisions do not depend on the Transformers version; the plans here are resolved with
# 5.x glob semantics so that entries such as "norm" or "*" mean the same in every nox session.
SEMANTICS = "5.10.4"


def plan_for(model: nn.Module, dtype: torch.dtype = BF16) -> KeepPlan:
    return resolve_keep_plan(model, dtype, transformers_version=SEMANTICS)


def layout_of(model: nn.Module, dtype: torch.dtype = BF16, **kwargs: object) -> Layout:
    plan = plan_for(model, dtype)
    keep_aware_cast(model, dtype, plan=plan)
    return plan_layout(model, plan, **kwargs)  # type: ignore[arg-type]


def units(layout: Layout) -> list[tuple[str, tuple[str, ...]]]:
    return [(unit.kind, unit.module_fqns) for unit in layout.units]


def test_kept_modules_are_units_of_their_own_sharded_first() -> None:
    layout = layout_of(stack_class(strict=["wo"])())
    assert units(layout) == [
        ("kept", ("layers.0.wo",)),
        ("kept", ("layers.1.wo",)),
        ("standard", ("layers.0",)),
        ("standard", ("layers.1",)),
        ("root", ("",)),
    ]
    assert layout.owner["layers.0.wo.weight"] == "layers.0.wo"
    assert layout.owner["layers.0.attn.weight"] == "layers.0"
    assert layout.owner["embed.weight"] == "<root>"


def test_no_declaration_is_exactly_plain_fsdp2() -> None:
    layout = layout_of(Stack())
    assert units(layout) == [
        ("standard", ("layers.0",)),
        ("standard", ("layers.1",)),
        ("root", ("",)),
    ]


def test_topmost_fully_kept_module_wins_over_its_children() -> None:
    # every parameter of the block's MLP (and its Linear child) is kept: one unit at `mlp`
    layout = layout_of(stack_class(strict=["mlp"])())
    assert ("kept", ("layers.0.mlp",)) in units(layout)
    assert all("layers.0.mlp.0" not in unit.module_fqns for unit in layout.units)


def test_container_without_forward_resolves_to_callable_descendants() -> None:
    # `layers` is a ModuleList: FSDP2's forward hooks on it would never fire.
    layout = layout_of(stack_class(strict=["layers"])())
    kept = [fqns for kind, fqns in units(layout) if kind == "kept"]
    assert kept == [("layers.0",), ("layers.1",)]
    # kept units take their subtree out of the standard targets: nothing is sharded twice
    assert ("standard", ("layers.0",)) not in units(layout)


def test_whole_model_kept_is_one_kept_root_unit() -> None:
    model = stack_class(strict=["*"])()
    plan = plan_for(model)
    keep_aware_cast(model, BF16, plan=plan)
    layout = plan_layout(model, plan, wrap=[])
    assert units(layout) == [("kept", ("",))]


def test_group_kept_puts_one_blocks_kept_modules_in_one_unit() -> None:
    layout = layout_of(stack_class(strict=["norm"])(), group_kept=True)
    kept = sorted(fqns for kind, fqns in units(layout) if kind == "kept")
    assert kept == [
        ("layers.0.input_layernorm", "layers.0.post_attention_layernorm"),
        ("layers.1.input_layernorm", "layers.1.post_attention_layernorm"),
        ("norm",),
    ]


def test_group_kept_model_puts_every_kept_module_in_one_unit_that_stays_gathered() -> None:
    layout = layout_of(stack_class(strict=["norm"])(), group_kept="model")
    kept = [unit for unit in layout.units if unit.kind == "kept"]
    assert [unit.module_fqns for unit in kept] == [
        (
            "layers.0.input_layernorm",
            "layers.0.post_attention_layernorm",
            "layers.1.input_layernorm",
            "layers.1.post_attention_layernorm",
            "norm",
        )
    ]
    assert kept[0].stays_gathered
    assert layout.units[0] is kept[0]  # sharded before the blocks that contain its modules
    assert not any(unit.stays_gathered for unit in layout.units if unit.kind != "kept")
    assert "stays gathered" in layout.describe()


def test_group_kept_block_and_true_are_the_same_layout() -> None:
    model = stack_class(strict=["norm"])()
    assert units(layout_of(model, group_kept=True)) == units(layout_of(model, group_kept="block"))


def test_group_kept_unknown_value_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"group_kept='blocks' is not one of False .*'model'"):
        layout_of(stack_class(strict=["norm"])(), group_kept="blocks")  # type: ignore[arg-type]


def test_wrap_by_class_name_and_predicate() -> None:
    by_class = layout_of(Stack(), wrap=[Block])
    by_name = layout_of(Stack(), wrap=["Block"])
    by_predicate = layout_of(Stack(), wrap=lambda module: isinstance(module, Block))
    assert units(by_class) == units(by_name) == units(by_predicate)
    assert units(layout_of(Stack(), wrap=[])) == [("root", ("",))]


def test_wrap_naming_an_absent_class_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"wrap names class\(es\) \['LlamaDecoderLayer'\]"):
        layout_of(Stack(), wrap=["LlamaDecoderLayer"])
    with pytest.raises(TypeError, match="wrap must hold module classes or class names"):
        layout_of(Stack(), wrap=[3])


# --- fail closed ---------------------------------------------------------------------------


def problems(error: pytest.ExceptionInfo[KeepLayoutError]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for problem in error.value.problems:
        found.setdefault(problem.reason, set()).add(problem.fqn)
    return found


def root_owning(*names: str) -> nn.Module:
    """A stack whose root owns ``query_tokens`` (kept) and the other ``names`` (not kept)."""
    model = stack_class(strict=["query_tokens"])()
    for name in ("query_tokens", *names):
        model.register_parameter(name, nn.Parameter(torch.randn(2, 8)))
    return model


def test_root_owned_kept_parameter() -> None:
    # The root also owns a parameter that is not kept: no unit can hold both, refused.
    with pytest.raises(KeepLayoutError) as error:
        layout_of(root_owning("scale"))
    assert problems(error) == {"root-owned": {"query_tokens"}}
    assert isinstance(error.value, ValueError)
    assert "query_tokens" in str(error.value) and "nothing was sharded" in str(error.value)
    assert (
        "which cannot be an FP32 unit of its own: it also directly owns parameters the plan "
        "does not keep (scale (torch.bfloat16))"
    ) in " ".join(str(error.value).split())


def test_kept_parameter_sharing_a_module_with_low_precision_ones() -> None:
    # Rwkv's shape: the attention module owns time_decay and also Linear children.
    model = stack_class(strict=["time_decay"])()
    for layer in model.layers:
        layer.attn.register_parameter("time_decay", nn.Parameter(torch.randn(8)))
    with pytest.raises(KeepLayoutError) as error:
        layout_of(model)
    assert problems(error) == {
        "mixed-unit": {"layers.0.attn.time_decay", "layers.1.attn.time_decay"}
    }
    assert "layers.0" in str(error.value)


def test_frozen_kept_parameter_in_a_mixed_module_is_replicated() -> None:
    # Afmoe's expert_bias / DeepSeek's correction bias: frozen, owned by the MoE block.
    model = stack_class(strict=["time_decay"])()
    for layer in model.layers:
        bias = nn.Parameter(torch.randn(8), requires_grad=False)
        layer.attn.register_parameter("time_decay", bias)
    layout = layout_of(model)
    assert layout.replicated == ("layers.0.attn.time_decay", "layers.1.attn.time_decay")
    assert layout.owner["layers.0.attn.time_decay"] == "<replicated>"
    assert "replicated" in layout.describe()
    # without replication support (older torch) it is refused like a trainable one
    with pytest.raises(KeepLayoutError, match="mixed-unit"):
        plan_layout(model, plan_for(model), replicate_frozen=False)


def test_kept_parameter_already_degraded() -> None:
    model = stack_class(strict=["wo"])()
    plan = plan_for(model)
    model.to(BF16)  # blanket cast instead of keep_aware_cast
    with pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan)
    assert problems(error) == {"degraded": {"layers.0.wo.weight", "layers.1.wo.weight"}}
    assert "keep_aware_cast" in str(error.value)


def test_tied_aliases_across_units() -> None:
    # One alias owned by the root itself: no fully_shard call can group the root with a block's
    # module (the root is the outermost unit), so the tie cannot be kept in one unit.
    model = Stack()
    model.register_parameter("tied", model.layers[0].attn.weight)
    with pytest.raises(KeepLayoutError) as error:
        layout_of(model)
    assert problems(error) == {"tied-across-units": {"tied"}}
    assert "'layers.0.attn.weight'" in str(error.value)


def test_tied_aliases_inside_one_unit_are_fine() -> None:
    model = Stack()
    model.head.weight = model.embed.weight  # both owned by the root unit
    layout = layout_of(model)
    assert layout.owner["head.weight"] == layout.owner["embed.weight"] == "<root>"


def test_mixed_storage_dtypes_without_a_plan() -> None:
    # The accelerate reproducer: norms forced to fp32 in a bf16 model, nothing declared.
    model = Stack().to(BF16)
    for name, module in model.named_modules():
        if "norm" in name:
            module.to(FP32)
    with pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan_for(model))
    found = problems(error)
    assert set(found) == {"mixed-dtype-unit"}
    assert "layers.0.input_layernorm.weight" in found["mixed-dtype-unit"]
    assert "uniform original parameter dtype" in str(error.value)
    assert "upcast_to_fp32_master" in str(error.value)


def test_frozen_parameters_of_another_dtype_are_allowed() -> None:
    # FSDP2 only requires uniform dtypes among trainable parameters.
    model = Stack().to(BF16)
    model.layers[0].input_layernorm.to(FP32).requires_grad_(False)
    plan_layout(model, plan_for(model))


def test_every_problem_is_reported_at_once() -> None:
    model = stack_class(strict=["query_tokens", "wo"])()
    model.register_parameter("query_tokens", nn.Parameter(torch.randn(2, 8)))
    model.register_parameter("scale", nn.Parameter(torch.randn(2, 8)))
    plan = plan_for(model)
    model.to(BF16)
    with pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan)
    assert set(problems(error)) == {"root-owned", "degraded"}
    assert set(error.value.fqns) >= {"query_tokens", "layers.0.wo.weight", "layers.1.wo.weight"}
