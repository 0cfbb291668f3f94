"""Layout planning (pure) for a root that owns kept parameters and for tied tensors whose
aliases' modules would fall in different units (issue 23).

The expected units are written from the toys' code (which module owns what, which the root
calls), not read back from the layout: the root's unit must hold its kept parameters and nothing
else, every tied tensor exactly one unit, and every unit must be sharded after each unit inside
it (``fully_shard`` claims what is not yet claimed below it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp32keep import KeepLayoutError, plan_layout
from fp32keep.layout import planning as layout_module
from fp32keep.layout.units import Layout
from tests.core.root_toys import (
    MixedRootStack,
    QueryStack,
    ReadingRootStack,
    TiedKeptStack,
    TinyLM,
)
from tests.core.toys import Stack, cast_bf16, stack_class

BF16 = torch.bfloat16


def layout_of(model: nn.Module, **kwargs: object) -> Layout:
    return plan_layout(model, cast_bf16(model), **kwargs)  # type: ignore[arg-type]


def units(layout: Layout) -> dict[tuple[str, ...], str]:
    return {unit.module_fqns: unit.kind for unit in layout.units}


def position(layout: Layout, *fqns: str) -> int:
    return [unit.module_fqns for unit in layout.units].index(fqns)


def refusal(model: nn.Module) -> KeepLayoutError:
    with pytest.raises(KeepLayoutError) as error:
        layout_of(model)
    return error.value


# --- a root that owns kept parameters -----------------------------------------------------

TIED_LM = ("language_model.embed_tokens", "language_model.lm_head")


def test_root_owning_only_kept_parameters_is_an_fp32_unit_sharded_last() -> None:
    layout = layout_of(QueryStack())
    assert units(layout) == {
        ("qformer.layers.0",): "kept",  # wrap targets inside the kept Q-Former: nested
        ("qformer.layers.1",): "kept",
        ("qformer",): "kept",
        ("language_model.layers.0",): "standard",
        ("language_model.layers.1",): "standard",
        # the embedding the root calls, grouped with the head tied to it
        TIED_LM: "standard",
        ("vision",): "standard",  # every other child of the root: a unit of its own
        ("projection",): "standard",
        ("language_model",): "standard",
        ("",): "kept",
    }
    assert layout.units[-1].module_fqns == ("",)
    # the root's FP32 unit holds its kept parameter and nothing else
    assert [name for name, label in layout.owner.items() if label == "<root>"] == ["query_tokens"]
    group = f"[{', '.join(TIED_LM)}]"
    assert layout.owner["language_model.embed_tokens.weight"] == group
    assert layout.owner["language_model.lm_head.weight"] == group
    assert position(layout, *TIED_LM) < position(layout, "language_model")
    assert not layout.replicated


def test_root_without_get_input_embeddings_gives_each_child_a_unit() -> None:
    model = stack_class(strict=["query_tokens"])()
    model.register_parameter("query_tokens", nn.Parameter(torch.randn(2, 8)))
    layout = layout_of(model)
    assert units(layout) == {
        ("layers.0",): "standard",  # the ModuleList resolves to its blocks (wrap targets)
        ("layers.1",): "standard",
        ("embed",): "standard",
        ("norm",): "standard",
        ("head",): "standard",
        ("",): "kept",
    }


def test_frozen_root_owned_kept_parameter_stays_replicated_under_the_root_unit() -> None:
    model = QueryStack()
    model.query_tokens.requires_grad_(False)
    layout = layout_of(model)
    assert layout.replicated == ("query_tokens",)
    assert units(layout)[("",)] == "root"


def test_root_also_owning_a_parameter_not_kept_is_refused_naming_it() -> None:
    error = refusal(MixedRootStack())
    assert [(p.fqn, p.reason) for p in error.problems] == [("query_tokens", "root-owned")]
    assert (
        "which cannot be an FP32 unit of its own: it also directly owns parameters the plan "
        "does not keep (scale (torch.bfloat16))"
    ) in str(error)


def test_root_reading_a_childs_weight_is_refused_naming_the_read() -> None:
    error = refusal(ReadingRootStack())
    assert [(p.fqn, p.reason) for p in error.problems] == [("query_tokens", "root-owned")]
    assert "ReadingRootStack reads head.weight without calling 'head'" in str(error)


def test_root_without_a_forward_is_refused_saying_so() -> None:
    class NoForward(nn.Module):  # the plugin's refusal toy: a container root
        _keep_in_fp32_modules_strict = ("query_tokens",)

        def __init__(self) -> None:
            super().__init__()
            self.query_tokens = nn.Parameter(torch.randn(2, 8))
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    error = refusal(NoForward())
    assert [(p.fqn, p.reason) for p in error.problems] == [("query_tokens", "root-owned")]
    assert "cannot be an FP32 unit of its own: it has no forward of its own" in str(error)


def test_frozen_root_owned_parameter_without_replication_is_refused_saying_so() -> None:
    model = QueryStack()
    model.query_tokens.requires_grad_(False)
    with pytest.raises(KeepLayoutError) as error:  # a torch without ignored_params
        plan_layout(model, cast_bf16(model), replicate_frozen=False)
    assert [(p.fqn, p.reason) for p in error.value.problems] == [("query_tokens", "root-owned")]
    assert "its kept parameters are frozen" in str(error.value)


def test_the_input_embedding_of_a_plain_module_is_not_guessed() -> None:
    # Without get_input_embeddings the root's children are the units; the embedding inside
    # the language model stays in its unit (and its tie with the head stays inside it too).
    class NoGetter(QueryStack):
        get_input_embeddings = None  # type: ignore[assignment]  # no accessor to ask

    layout = layout_of(NoGetter())
    assert TIED_LM not in units(layout)
    assert layout.owner["language_model.embed_tokens.weight"] == "language_model"


# --- tied tensors across units -------------------------------------------------------------


def test_kept_tie_across_kept_units_is_one_kept_unit() -> None:
    layout = layout_of(TiedKeptStack())
    assert units(layout)[("embed", "head")] == "kept"
    assert ("embed",) not in units(layout) and ("head",) not in units(layout)
    assert layout.owner["embed.weight"] == layout.owner["head.weight"] == "[embed, head]"
    assert position(layout, "embed", "head") < position(layout, "")


def test_kept_tie_with_the_root_stays_refused() -> None:
    # The root owns an alias of a kept block weight: nothing can group the root with a module.
    model = stack_class(strict=["wo"])()
    model.register_parameter("wo_alias", model.layers[0].wo.weight)
    error = refusal(model)
    assert {p.reason for p in error.problems} == {"tied-across-units"}
    assert "layers.0.wo.weight" in str(error)


def test_kept_tie_with_a_module_holding_parameters_not_kept_stays_refused() -> None:
    # A kept unit all-gathers in FP32 whatever it holds: the block owning a kept alias beside
    # its bf16 attention cannot join the kept embedding's unit.
    model = TiedKeptStack()
    model.layers[1].register_parameter("alias", model.embed.weight)
    error = refusal(model)
    assert "tied-across-units" in {p.reason for p in error.problems}


def test_tie_between_blocks_is_one_unit_of_the_two_modules() -> None:
    model = Stack()
    model.layers[1].attn.weight = model.layers[0].attn.weight
    layout = layout_of(model)
    assert units(layout)[("layers.0.attn", "layers.1.attn")] == "standard"
    assert layout.owner["layers.1.attn.weight"] == "[layers.0.attn, layers.1.attn]"


def test_a_group_spanning_depths_waits_for_the_units_inside_it() -> None:
    # Tied between layers.0.mlp.0 (depth 4) and layers.1 (depth 2), which holds the kept unit
    # layers.1.wo (depth 3): sorted by depth alone the group would claim layers.1.wo's weight.
    model = stack_class(strict=["wo"])()
    model.layers[1].register_parameter("tied", model.layers[0].mlp[0].weight)
    layout = layout_of(model)
    group = ("layers.0.mlp.0", "layers.1")
    assert units(layout)[group] == "standard"
    assert position(layout, "layers.1.wo") < position(layout, *group) < position(layout, "")
    assert position(layout, *group) < position(layout, "layers.0")
    assert layout.owner["layers.1.wo.weight"] == "layers.1.wo"


def test_tied_lm_alone_stays_one_unit() -> None:
    # Embedding and head under one standard unit: no group needed, the layout is unchanged.
    class LMStack(TinyLM):
        _no_split_modules = ("Block",)

    layout = layout_of(LMStack())
    assert units(layout) == {("layers.0",): "standard", ("layers.1",): "standard", ("",): "root"}


def _with_embedding_reached_twice() -> QueryStack:
    """Transformers 4.x's T5 hands its ``shared`` embedding to its stacks as ``embed_tokens``: one
    object under two names. Here the input embedding the root calls (its own unit, tied to the
    head) is also a child of the language model's first block."""
    model = QueryStack()
    model.language_model.layers[0].embed_tokens = model.language_model.embed_tokens
    return model


def test_a_module_reached_under_two_names_is_held_by_the_unit_of_its_object() -> None:
    layout = layout_of(_with_embedding_reached_twice())
    assert units(layout)[TIED_LM] == "standard"
    group = layout.owner["language_model.embed_tokens.weight"]
    assert layout.owner["language_model.layers.0.embed_tokens.weight"] == group


def test_negative_control_placed_by_name_the_second_name_falls_in_the_blocks_unit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each name its own path (the layout before it placed modules by object): the alias under
    # the block's unit reads as a tie across units.
    monkeypatch.setattr(
        layout_module,
        "_first_names",
        lambda model: {fqn: fqn for fqn, _ in model.named_modules(remove_duplicate=False)},
    )
    error = refusal(_with_embedding_reached_twice())
    assert {p.reason for p in error.problems} == {"tied-across-units"}
