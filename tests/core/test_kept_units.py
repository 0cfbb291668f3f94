"""Kept units FSDP2 can hold: owners with children, nested units, modules read without a call.

And the refusals that remain, each saying what is true of the model (the real reason and dtype).
Decided without a process group; tests/multirank/test_kept_units_fsdp2.py runs the same shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp32keep import KeepLayoutError, keep_aware_cast, plan_layout, resolve_keep_plan
from fp32keep.layout.units import Layout
from fp32keep.uses.source import find_direct_read, unseen_uses
from tests.core.kept_toys import ConvReadStack, EncodeStack, ReadStack, SinkStack, TowerStack
from tests.core.toys import stack_class

BF16 = torch.bfloat16
SEMANTICS = "5.10.4"  # 5.x glob entries, whatever the installed release (see test_layout.py)


def layout_of(model: nn.Module, **kwargs: object) -> Layout:
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(model, BF16, plan=plan)
    return plan_layout(model, plan, **kwargs)  # type: ignore[arg-type]


def units(layout: Layout) -> list[tuple[str, tuple[str, ...]]]:
    return [(unit.kind, unit.module_fqns) for unit in layout.units]


def refusal(model: nn.Module) -> KeepLayoutError:
    with pytest.raises(KeepLayoutError) as error:
        layout_of(model)
    return error.value


# --- owners with children ------------------------------------------------------------------


def test_owner_of_only_kept_parameters_is_a_kept_unit_after_its_children() -> None:
    layout = layout_of(SinkStack())
    order = units(layout)
    assert order.index(("standard", ("layers.0.self_attn.q_proj",))) < order.index(
        ("kept", ("layers.0.self_attn",))
    )
    assert order.index(("kept", ("layers.0.self_attn",))) < order.index(("standard", ("layers.0",)))
    assert layout.owner["layers.0.self_attn.sinks"] == "layers.0.self_attn"
    assert layout.owner["layers.0.self_attn.q_proj.weight"] == "layers.0.self_attn.q_proj"
    assert layout.owner["layers.0.input_layernorm.weight"] == "layers.0"
    assert layout.replicated == ()


def test_owner_that_also_owns_a_parameter_not_kept_is_still_refused_saying_so() -> None:
    # Negative control: the owner rule must not swallow a truly mixed module (Rwkv's shape).
    model = SinkStack()
    for layer in model.layers:
        layer.self_attn.register_parameter("scale", nn.Parameter(torch.ones(8)))
    error = refusal(model)
    assert {p.reason for p in error.problems} == {"mixed-unit"}
    assert set(error.fqns) == {"layers.0.self_attn.sinks", "layers.1.self_attn.sinks"}
    text = str(error)
    assert "'layers.0.self_attn' (SinkAttention) also directly owns parameters" in text
    assert "scale (torch.bfloat16)" in text and "is kept (torch.float32)" in text
    assert "owns parameters that are not kept" not in text  # the old, false wording


# --- nested kept units ---------------------------------------------------------------------


def test_fully_kept_subtree_nests_kept_units_at_its_wrap_targets() -> None:
    layout = layout_of(TowerStack())
    order = units(layout)
    kept = [fqns for kind, fqns in order if kind == "kept"]
    assert kept == [("tower.layers.0",), ("tower.layers.1",), ("tower",)]
    assert order.index(("kept", ("tower.layers.1",))) < order.index(("kept", ("tower",)))
    assert layout.owner["tower.layers.0.dense.weight"] == "tower.layers.0"
    assert layout.owner["tower.proj_in.weight"] == "tower"
    assert ("standard", ("block",)) in order


def test_nested_units_are_not_grouped() -> None:
    layout = layout_of(TowerStack(), group_kept="model")
    kept = [unit for unit in layout.units if unit.kind == "kept"]
    assert [unit.module_fqns for unit in kept] == [
        ("tower.layers.0",),
        ("tower.layers.1",),
        ("tower",),
    ]
    assert [unit.stays_gathered for unit in kept] == [False, False, True]


# --- kept modules read without a call ------------------------------------------------------


def test_frozen_kept_module_read_without_a_call_is_replicated_not_a_unit() -> None:
    layout = layout_of(ReadStack())
    assert all("encoder.embed_positions" not in unit.module_fqns for unit in layout.units)
    assert layout.replicated == ("encoder.embed_positions.weight",)


def test_trainable_kept_module_read_without_a_call_goes_with_its_reader() -> None:
    # Bailing-Hybrid's shape: the attention hands conv.weight to a kernel, never calls conv.
    layout = layout_of(ConvReadStack())
    order = units(layout)
    assert ("kept", ("layers.0.self_attn",)) in order
    assert all("layers.0.self_attn.conv" not in fqns for _, fqns in order)
    assert order.index(("standard", ("layers.0.self_attn.q_proj",))) < order.index(
        ("kept", ("layers.0.self_attn",))
    )
    assert layout.owner["layers.0.self_attn.conv.weight"] == "layers.0.self_attn"
    assert layout.owner["layers.0.self_attn.o_proj.weight"] == "layers.0.self_attn.o_proj"
    assert layout.owner["layers.0.norm.weight"] == "layers.0"
    # Voxtral's shape made trainable: the reader owns nothing itself, its blocks are targets.
    model = ReadStack()
    model.encoder.embed_positions.requires_grad_(True)
    held = layout_of(model)
    assert held.owner["encoder.embed_positions.weight"] == "encoder"
    assert held.replicated == ()


def test_trainable_kept_module_read_without_a_call_is_refused_naming_it() -> None:
    # Negative control: a reader that also owns a parameter not kept cannot hold the read
    # module (its unit would be of mixed dtype); the refusal names the reader and the dtype.
    model = ReadStack()
    model.encoder.embed_positions.requires_grad_(True)
    model.encoder.register_parameter("scale", nn.Parameter(torch.ones(8)))
    error = refusal(model)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("encoder.embed_positions.weight", "read-not-called")
    ]
    text = str(error)
    assert "module 'encoder.embed_positions', which PositionReader reads directly" in text
    assert "(embed_positions.weight) without calling it" in text
    assert "mixed torch.Tensor and DTensor" in text and "freeze it" in text
    assert "its reader 'encoder' (PositionReader) also directly owns parameters" in text
    assert "scale (torch.bfloat16)" in text
    # without replication support (older torch) the frozen one is refused the same way
    frozen = ReadStack()
    plan = resolve_keep_plan(frozen, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(frozen, BF16, plan=plan)
    with pytest.raises(KeepLayoutError, match="read-not-called"):
        plan_layout(frozen, plan, replicate_frozen=False)


def test_direct_read_detection_needs_a_read_and_no_call() -> None:
    # Negative controls: Block reads `self.wo.weight.dtype` (metadata) and calls `self.wo(...)`.
    model = stack_class(strict=["wo"])()
    assert find_direct_read(model, "layers.0.wo") is None
    assert find_direct_read(ReadStack(), "encoder.layers.0") is None  # a ModuleList entry
    read = find_direct_read(ReadStack(), "encoder.embed_positions")
    assert read is not None and (read.reader, read.expression) == (
        "PositionReader",
        "embed_positions.weight",
    )


# --- messages that say what is true ---------------------------------------------------------


def test_root_owned_names_the_root_and_the_dtypes() -> None:
    model = stack_class(strict=["query_tokens"])()
    model.register_parameter("query_tokens", nn.Parameter(torch.randn(2, 8)))
    model.register_parameter("scale", nn.Parameter(torch.randn(2, 8)))  # not kept: a mixed root
    error = refusal(model)
    text = str(error)
    assert (
        "[root-owned] is kept (torch.float32) but no fp32-keep unit owns it: it is owned "
        "directly by the root module (KeptStack)"
    ) in text
    assert "(the plan is for torch.bfloat16)" in text


def test_tied_across_units_names_the_dtype() -> None:
    model = stack_class(strict=["wo"])()
    model.register_parameter("tied", model.layers[0].attn.weight)  # the root cannot be grouped
    error = refusal(model)
    assert [p.reason for p in error.problems] == ["tied-across-units"]
    assert (
        "[tied-across-units] is tied across FSDP2 unit boundaries: one torch.bfloat16 tensor, "
        "named ['tied', 'layers.0.attn.weight'], falls in units ['<root>', 'layers.0']"
    ) in str(error)


def test_frozen_owner_parameters_stay_replicated() -> None:
    # A router's frozen correction bias beside its Linear children: no collective needed at all.
    model = SinkStack()
    for layer in model.layers:
        layer.self_attn.sinks.requires_grad_(False)
    layout = layout_of(model)
    assert layout.replicated == ("layers.0.self_attn.sinks", "layers.1.self_attn.sinks")
    assert all(unit.kind != "kept" for unit in layout.units)


def test_methods_a_parent_calls_instead_of_forward_are_named_as_unseen() -> None:
    # The source cannot tell whether encode runs the tokenizer's parameters: it names the call
    # for the warning. Calls through forward, or through methods nn.Module defines (`.float()`,
    # `.to(...)`), are nothing to name.
    assert unseen_uses(EncodeStack()) == [
        "EncodeStack.forward(): self.tokenizer.encode(...), a method other than forward"
    ]
    assert unseen_uses(ReadStack()) == []
