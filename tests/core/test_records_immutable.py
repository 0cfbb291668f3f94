"""``KeepPlan`` and ``Layout`` are immutable through and through and hashable; ``plan`` is
keyword-only in ``keep_aware_cast``. Single process, toy models."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from types import MappingProxyType

import pytest
import torch

import fp32keep
from fp32keep import KeepMatch, KeepPlan, Layout, Unit
from fp32keep.frozen import FrozenMapping
from tests.core.toys import SEMANTICS, cast_bf16, stack_class

BF16, FP16 = torch.bfloat16, torch.float16


def plan_of(dtype: torch.dtype = BF16) -> KeepPlan:
    model = stack_class(regular=["wo"], strict=["norm"])()
    return fp32keep.resolve_keep_plan(model, dtype, transformers_version=SEMANTICS)


def test_equal_plans_hash_alike_and_key_a_dict() -> None:
    first, second = plan_of(), plan_of()
    assert first is not second and first.matches  # two resolutions, something kept
    assert first == second
    assert hash(first) == hash(second)
    assert {first: "cached"}[second] == "cached"
    assert len({first, second, plan_of(FP16)}) == 2  # another dtype is another plan


def test_a_plan_differing_in_one_match_differs_and_hashes_apart() -> None:
    plan = plan_of()
    name = sorted(plan.matches)[0]
    fewer = dataclasses.replace(plan, matches={n: m for n, m in plan.matches.items() if n != name})
    assert fewer != plan
    assert hash(fewer) != hash(plan)  # frozenset hashes of different items: apart in practice


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda plan: setattr(plan, "dtype", FP16), id="field"),
        pytest.param(lambda plan: plan.matches.__setitem__("x", None), id="matches-item"),
        pytest.param(lambda plan: plan.matches.pop("x", None), id="matches-pop"),
        pytest.param(lambda plan: setattr(plan.matches, "_items", {}), id="matches-store"),
        pytest.param(lambda plan: plan.param_names.add("x"), id="param-names"),
        pytest.param(lambda plan: plan.buffer_names.add("x"), id="buffer-names"),
        pytest.param(lambda plan: plan.regular_entries.append("x"), id="regular-entries"),
        pytest.param(lambda plan: plan.strict_entries.append("x"), id="strict-entries"),
        pytest.param(lambda plan: plan.declared_by.append("x"), id="declared-by"),
        pytest.param(lambda plan: plan.unobserved.append("x"), id="unobserved"),
        pytest.param(
            lambda plan: setattr(plan.matches[sorted(plan.matches)[0]], "entry", "x"),
            id="a-match",
        ),
    ],
)
def test_no_part_of_a_plan_can_be_changed(mutate: object) -> None:
    plan = plan_of()
    before = (plan.digest(), repr(plan), dict(plan.matches))
    with pytest.raises((dataclasses.FrozenInstanceError, TypeError, AttributeError)):
        mutate(plan)  # type: ignore[operator]
    assert (plan.digest(), repr(plan), dict(plan.matches)) == before


def test_a_plan_built_from_mutable_collections_copies_them() -> None:
    plan = plan_of()
    matches = dict(plan.matches)
    names = set(plan.param_names)
    entries = list(plan.strict_entries)
    built = dataclasses.replace(
        plan,
        matches=matches,
        param_names=names,
        strict_entries=entries,  # type: ignore[arg-type]
    )
    assert built == plan and hash(built) == hash(plan)
    matches.clear()
    names.clear()
    entries.clear()
    assert built.matches == plan.matches and built.param_names == plan.param_names
    assert built.strict_entries == plan.strict_entries
    assert isinstance(built.param_names, frozenset) and isinstance(built.strict_entries, tuple)


def test_a_read_only_view_would_not_have_been_enough() -> None:
    """Negative control: the old ``MappingProxyType`` over the resolver's dict is neither a copy
    nor hashable, so the two tests above would fail on it."""
    source = {"a.wo.weight": KeepMatch("wo", "regular")}
    view = MappingProxyType(source)
    source.clear()
    assert dict(view) == {}  # changed under the reader's feet
    with pytest.raises(TypeError, match="unhashable"):
        hash(view)


def test_a_plan_survives_pickling_and_deep_copies() -> None:
    plan = plan_of()
    for copied in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan)):
        assert copied == plan and hash(copied) == hash(plan)
        assert isinstance(copied.matches, FrozenMapping)


def test_the_frozen_mapping_reads_like_the_dict_it_copied() -> None:
    items = {"b": 1, "a": 2}
    frozen = FrozenMapping(items)
    assert frozen == items and list(frozen) == ["b", "a"] and len(frozen) == 2
    assert repr(frozen) == "FrozenMapping({'b': 1, 'a': 2})"
    assert frozen != {"b": 1} and FrozenMapping() == {}
    assert hash(frozen) == hash(FrozenMapping({"a": 2, "b": 1}))  # order is not identity


def layout_of() -> Layout:
    model = stack_class(strict=["wo"])()
    return fp32keep.plan_layout(model, cast_bf16(model))


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda layout: setattr(layout, "owner", {}), id="field"),
        pytest.param(lambda layout: layout.owner.__setitem__("x", "y"), id="owner-item"),
        pytest.param(lambda layout: layout.owner.clear(), id="owner-clear"),
        pytest.param(lambda layout: layout.forward_methods.__setitem__("x", ()), id="methods"),
        pytest.param(lambda layout: layout.units.append(layout.units[0]), id="units"),
        pytest.param(lambda layout: layout.replicated.append("x"), id="replicated"),
        pytest.param(lambda layout: setattr(layout.units[0], "depth", 9), id="a-unit"),
    ],
)
def test_no_part_of_a_layout_can_be_changed(mutate: object) -> None:
    layout = layout_of()
    before = (layout.describe(), dict(layout.owner))
    with pytest.raises((dataclasses.FrozenInstanceError, TypeError, AttributeError)):
        mutate(layout)  # type: ignore[operator]
    assert (layout.describe(), dict(layout.owner)) == before


def test_a_layout_built_from_mutable_collections_copies_them_and_hashes() -> None:
    owner = {"w": "<root>"}
    methods = {"": ["encode"]}
    units = [Unit("root", [""], 0)]  # type: ignore[arg-type]
    layout = Layout(units, owner, ["r"], methods)  # type: ignore[arg-type]
    owner.clear()
    methods[""].append("decode")
    assert layout.owner == {"w": "<root>"} and layout.forward_methods == {"": ("encode",)}
    assert layout.units == (Unit("root", ("",), 0),) and layout.replicated == ("r",)
    same = Layout((Unit("root", ("",), 0),), {"w": "<root>"}, ("r",), {"": ("encode",)})
    assert layout == same and hash(layout) == hash(same)
    assert layout_of() == layout_of() and hash(layout_of()) == hash(layout_of())


def test_plan_is_keyword_only_in_keep_aware_cast() -> None:
    parameter = inspect.signature(fp32keep.keep_aware_cast).parameters["plan"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    model = stack_class(strict=["wo"])()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    with pytest.raises(TypeError, match="positional"):
        fp32keep.keep_aware_cast(model, BF16, plan)  # type: ignore[misc]
    assert all(param.dtype == torch.float32 for param in model.parameters())  # not cast
