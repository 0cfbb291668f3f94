"""What a forward is observed to use, and what the source scan finds without one (issue 22).

Decided without a process group: the observation (:func:`fp32keep.observe_parameter_use`), the
layout planned from it or from the source, and the methods each would gather a unit around.
tests/multirank/test_observed_use_fsdp2.py runs the same toys sharded.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from fp32keep import (
    KeepLayoutError,
    ParameterUse,
    keep_aware_cast,
    observe_parameter_use,
    plan_layout,
)
from fp32keep import resolve_keep_plan as resolve
from fp32keep.layout.units import Layout
from fp32keep.uses.observe import CALL
from fp32keep.uses.source import find_direct_read, unseen_uses
from tests.core.kept_toys import ConvReadStack, EncodeStack, ReadStack, SinkStack, TowerStack
from tests.core.observed_toys import (
    ChildCalledStack,
    ChildNotCalledStack,
    HelperStack,
    InheritedCallStack,
    InheritedReadStack,
    NestedCallsStack,
)

BF16 = torch.bfloat16
SEMANTICS = "5.10.4"  # 5.x glob entries, whatever the installed release


def cast(model: nn.Module) -> nn.Module:
    keep_aware_cast(model, BF16, plan=resolve(model, BF16, transformers_version=SEMANTICS))
    return model


def observe(model: nn.Module) -> ParameterUse:
    """One forward and backward of ``model`` (cast), observed, under autocast as training runs."""
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(7))
    with observe_parameter_use(model) as use:
        with torch.autocast("cpu", dtype=BF16):
            logits = model(ids)
        logits.float().logsumexp(-1).mean().backward()
    return use


def layouts(model: nn.Module) -> dict[str, Layout]:
    """The layout planned from the source, and from an observed forward."""
    plan = resolve(model, BF16, transformers_version=SEMANTICS)
    return {
        "source": plan_layout(model, plan),
        "observed": plan_layout(model, plan, observed=observe(model)),
    }


def units(layout: Layout) -> list[tuple[str, tuple[str, ...]]]:
    return [(unit.kind, unit.module_fqns) for unit in layout.units]


# --- a read inside an inherited forward ----------------------------------------------------


def test_the_source_scan_finds_a_read_in_an_inherited_forward() -> None:
    # The encoder's class defines nothing; the read is in the forward of a base class.
    model = cast(InheritedReadStack())
    read = find_direct_read(model, "encoder.embed_positions")
    assert read is not None
    assert (read.reader, read.reader_fqn, read.expression) == (
        "InheritedPositionReader",
        "encoder",
        "embed_positions.weight",
    )
    layout = plan_layout(model, resolve(model, BF16, transformers_version=SEMANTICS))
    assert layout.replicated == ("encoder.embed_positions.weight",)
    assert all("encoder.embed_positions" not in unit.module_fqns for unit in layout.units)


def test_a_read_in_an_inherited_forward_is_observed_where_it_happens() -> None:
    model = cast(InheritedReadStack())
    read = observe(model).direct_read(model, "encoder.embed_positions")
    assert read is not None
    assert (read.reader, read.reader_fqn, read.expression, read.evidence) == (
        "InheritedPositionReader",
        "encoder",
        "embed_positions.weight",
        "observed in InheritedPositionReader.forward",
    )
    for how, layout in layouts(model).items():
        assert layout.replicated == ("encoder.embed_positions.weight",), how


def test_negative_control_an_inherited_forward_that_calls_the_module() -> None:
    # The same shape whose inherited forward calls embed_positions: no read, by either means,
    # and the kept module is a unit of its own.
    model = cast(InheritedCallStack())
    assert find_direct_read(model, "encoder.embed_positions") is None
    assert observe(model).direct_read(model, "encoder.embed_positions") is None
    for how, layout in layouts(model).items():
        assert ("kept", ("encoder.embed_positions",)) in units(layout), how
        assert layout.replicated == (), how


def test_a_kept_parameter_used_outside_its_unit_is_refused_naming_the_stack() -> None:
    # The parent calls scaler.proj itself: proj's weights belong to the scaler's unit, which
    # FSDP2 gathers only in the scaler's call. The observation refuses it, saying where; the
    # source scan of the unit's ancestors (fp32keep.layout.reach) finds the call too.
    model = cast(ChildCalledStack())
    plan = resolve(model, BF16, transformers_version=SEMANTICS)
    with pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan, observed=observe(model))
    assert [(p.fqn, p.reason) for p in error.value.problems] == [
        ("scaler.proj.bias", "read-not-called"),
        ("scaler.proj.weight", "read-not-called"),
    ]
    text = str(error.value)
    assert "is kept (torch.float32) in unit 'scaler', but the observed forward used it in " in text
    assert "<root>.__call__ > <root>.forward > scaler.proj.__call__ > scaler.proj.forward" in text
    assert "mixed torch.Tensor and DTensor" in text and "freeze it" in text
    with pytest.raises(KeepLayoutError) as scanned:
        plan_layout(model, plan)
    assert [p.fqn for p in scanned.value.problems] == ["scaler.proj.bias", "scaler.proj.weight"]
    assert "(scaler.proj(...); called in ChildCalledStack.forward())" in str(scanned.value)


def test_negative_control_the_child_called_inside_its_unit_only() -> None:
    model = cast(ChildNotCalledStack())
    plan = resolve(model, BF16, transformers_version=SEMANTICS)
    assert ("kept", ("scaler",)) in units(plan_layout(model, plan, observed=observe(model)))


@pytest.mark.parametrize(
    "cls", [ReadStack, ConvReadStack, EncodeStack, SinkStack, TowerStack, InheritedReadStack]
)
def test_observation_and_source_agree_where_the_source_spells_it_out(cls: type) -> None:
    found = layouts(cast(cls()))
    assert found["observed"].units == found["source"].units
    assert found["observed"].replicated == found["source"].replicated
    if cls is not EncodeStack:  # a method other than forward: only a run shows its uses
        assert found["observed"].forward_methods == found["source"].forward_methods == {}


def test_the_source_gathers_no_method_and_names_the_calls_it_cannot_judge() -> None:
    # EncodeStack runs its kept tokenizer through `self.tokenizer.encode(...)`: observed, the
    # tokenizer is gathered around encode; from the source, nothing is, and the call is named.
    model = cast(EncodeStack())
    found = layouts(model)
    assert found["observed"].forward_methods == {"tokenizer": ("encode",)}
    assert found["source"].forward_methods == {}
    assert unseen_uses(model) == [
        "EncodeStack.forward(): self.tokenizer.encode(...), a method other than forward"
    ]
    # Negative control: a model that runs its kept modules by calls only shows nothing unseen.
    assert unseen_uses(cast(ReadStack())) == []


# --- which methods a unit is gathered around -----------------------------------------------


def test_observed_methods_are_the_outermost_ones_that_run_the_units_parameters() -> None:
    # The parent runs encode, quantize and roundtrip; forward calling encode, encode calling
    # quantize and roundtrip calling the codec happen inside a gathered call: no entry each.
    model = cast(NestedCallsStack())
    layout = layouts(model)["observed"]
    assert layout.forward_methods == {"codec": ("encode", "quantize", "roundtrip")}
    assert "kept       codec; gathered around codec.encode; gathered around codec.quantize" in (
        layout.describe()
    )


def test_a_pure_helper_is_not_gathered_and_the_source_names_both_calls() -> None:
    # Kyutai's shape: get_encoded_length computes a length from the conv's stride. Observed,
    # only encode runs the codec's parameters; the source cannot tell the two apart, so it
    # gathers neither and names both.
    model = cast(HelperStack())
    found = layouts(model)
    assert found["observed"].forward_methods == {"codec": ("encode",)}
    assert found["source"].forward_methods == {}
    assert unseen_uses(model) == [
        f"HelperStack.forward(): self.codec.{name}(...), a method other than forward"
        for name in ("get_encoded_length", "encode")
    ]


# --- what is recorded ----------------------------------------------------------------------


def test_only_forward_value_reads_are_recorded() -> None:
    # Block.forward reads `self.wo.weight.dtype` (metadata, no operator) and calls `self.wo`;
    # backward, and a deepcopy, run operators on every weight with no model frame: no use.
    model = cast(ReadStack())
    use = observe(model)
    with observe_parameter_use(model) as copied:
        copy.deepcopy(model)
    assert copied.used == frozenset()
    for name in use.used:
        for stack in use.stacks(name):
            assert stack[:2] == (("", CALL), ("", "forward")), (name, stack)
    assert use.direct_read(model, "encoder.layers.0.wo") is None
    # Negative control: a hook that reads wo's values outside wo's call is one.
    model.encoder.layers[0].register_forward_pre_hook(lambda m, a: m.wo.weight.sum())
    read = observe(model).direct_read(model, "encoder.layers.0.wo")
    assert read is not None and read.reader_fqn == "encoder.layers.0"
    assert read.evidence == "observed in a hook or call of Block (not its forward)"


def test_an_observation_travels_between_ranks_and_merges() -> None:
    model = cast(NestedCallsStack())
    use = observe(model)
    again = pickle.loads(pickle.dumps(use))
    assert again.digest() == use.digest() and again.describe() == use.describe()
    with observe_parameter_use(model) as idle:
        pass  # a rank whose forward never ran
    assert idle.used == frozenset() and idle.digest() != use.digest()
    assert idle.merged([use]).digest() == use.merged([idle]).digest() == use.digest()


def test_an_observation_names_what_does_not_fit() -> None:
    use = observe(cast(NestedCallsStack()))
    assert use.misfit(cast(NestedCallsStack())) is None
    text = use.misfit(cast(HelperStack())) or ""
    assert "the observation is of NestedCallsStack" in text and "HelperStack" in text
    assert "2 not observed, e.g. ['codec.conv.bias', 'codec.conv.weight']" in text
    assert "observed but absent, e.g. ['codec.out.bias'" in text
    with (
        pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got 'model'"),
        observe_parameter_use("model"),  # type: ignore[arg-type]
    ):
        pass
