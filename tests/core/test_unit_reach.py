"""Layout planning (pure): a parameter of a unit fp32keep makes, used by code outside that unit,
is refused before sharding (issue 23's fail-closed gap; :mod:`fp32keep.layout.reach`).

The toys (:mod:`tests.core.read_toys`) spell out who reads what; the expected refusals are
written from their code. tests/multirank/test_unit_reach_fsdp2.py shows the layouts refused here
crash at the first forward when sharded anyway, and the accepted ones run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp32keep
from fp32keep import KeepLayoutError, ParameterUse, plan_layout
from fp32keep.layout.units import Layout
from fp32keep.uses import source
from tests.core.read_toys import (
    CalledHeadReadingRoot,
    ChildCallingRoot,
    ChildForwardRoot,
    HeadCallingRoot,
    HeadForwardRoot,
    HeadReadingRoot,
    InspectingRoot,
    ProjReadingStack,
    SubtreeCallingRoot,
)
from tests.core.toys import cast_bf16

BF16 = torch.bfloat16


def observe(model: nn.Module) -> ParameterUse:
    with fp32keep.observe_parameter_use(model) as observed:
        model(torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(7)))
    return observed


def layout(model: nn.Module, *, observed: bool) -> Layout:
    plan = cast_bf16(model)
    return plan_layout(model, plan, observed=observe(model) if observed else None)


def refusal(model: nn.Module, *, observed: bool) -> KeepLayoutError:
    with pytest.raises(KeepLayoutError) as error:
        layout(model, observed=observed)
    return error.value


def flat(error: KeepLayoutError) -> str:
    return " ".join(str(error).split())


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_root_reading_a_weight_inside_a_child_unit_is_refused_naming_it(observed: bool) -> None:
    error = refusal(HeadReadingRoot(), observed=observed)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("decoder.head.weight", "read-not-called")
    ]
    text = flat(error)
    assert "is in unit 'decoder' (split out of the root module (HeadReadingRoot)" in text
    assert "owning only kept parameters (query_tokens)" in text  # what made the unit
    assert "HeadReadingRoot" in text and "('<root>') uses it outside that unit" in text
    assert "(decoder.head.weight;" in text  # the expression, from the reader
    assert "'mixed torch.Tensor and DTensor'" in text
    assert "Fix: call 'decoder.head' instead of reading its weight" in text
    assert "name its class, Linear, in wrap=..." in text
    if observed:
        assert "observed in <root>.__call__ > <root>.forward)" in text
    else:
        assert "read in HeadReadingRoot.forward())" in text


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_a_read_of_a_module_its_parent_also_calls_is_refused(observed: bool) -> None:
    # The decoder calls its head too: a call elsewhere does not gather it for the root's read.
    error = refusal(CalledHeadReadingRoot(), observed=observed)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("decoder.head.weight", "read-not-called")
    ]


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_a_call_from_outside_of_a_module_inside_the_unit_is_refused(observed: bool) -> None:
    # The root calls decoder.head after the decoder's unit ran and resharded: no unit around it.
    error = refusal(HeadCallingRoot(), observed=observed)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("decoder.head.weight", "read-not-called")
    ]
    text = flat(error)
    evidence = "<root>.forward > decoder.head.__call__" if observed else "(decoder.head(...);"
    assert evidence in text
    assert "Fix: the call gathers nothing, as 'decoder.head' is no unit" in text


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_an_explicit_forward_of_a_module_inside_the_unit_is_refused(observed: bool) -> None:
    # self.decoder.head.forward(h): the module it runs is the head (the source scan took the
    # chain for a call of a module 'decoder.head.forward', which owns nothing, and missed it).
    error = refusal(HeadForwardRoot(), observed=observed)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("decoder.head.weight", "read-not-called")
    ]
    source = "(decoder.head.forward(...);"
    evidence = "<root>.forward > decoder.head.forward" if observed else source
    assert evidence in flat(error)


def test_an_explicit_forward_of_a_units_own_module_is_refused() -> None:
    # self.head.forward(h), head a unit of its own: .forward skips the module's hooks, where
    # FSDP2 all-gathers, so the head runs sharded (a call, self.head(h), is the control).
    error = refusal(ChildForwardRoot(), observed=False)
    assert [(p.fqn, p.reason) for p in error.problems] == [("head.weight", "read-not-called")]
    text = flat(error)
    assert "(head.forward(...); called in ChildForwardRoot.forward())" in text
    assert "Fix: call 'head' itself, not its .forward" in text
    assert layout(ChildCallingRoot(), observed=False).units  # the call is accepted


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_a_call_of_a_container_inside_the_unit_names_the_parameters_below_it(
    observed: bool,
) -> None:
    error = refusal(SubtreeCallingRoot(), observed=observed)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("decoder.extra.0.bias", "read-not-called"),
        ("decoder.extra.0.weight", "read-not-called"),
    ]
    evidence = (
        "decoder.extra.__call__ > decoder.extra.forward > decoder.extra.0.__call__"
        if observed
        else "(decoder.extra(...);"
    )
    assert evidence in flat(error)


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_an_owner_reading_its_childs_weight_is_refused_naming_it(observed: bool) -> None:
    error = refusal(ProjReadingStack(), observed=observed)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        (f"layers.{i}.self_attn.o_proj.weight", "read-not-called") for i in (0, 1)
    ]
    text = flat(error)
    assert "is in unit 'layers.0.self_attn.o_proj' (split out of 'layers.0.self_attn'" in text
    assert "ProjReadingAttention" in text and "('layers.0.self_attn') uses it" in text
    assert "(o_proj.weight" in text
    # o_proj is a unit already: calling it is the whole fix
    assert "Fix: call 'layers.0.self_attn.o_proj' instead of reading its weight." in text


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_negative_control_a_root_that_calls_its_child_is_laid_out(observed: bool) -> None:
    found = layout(ChildCallingRoot(), observed=observed)
    assert ("head",) in [unit.module_fqns for unit in found.units]
    assert found.owner["head.weight"] == "head"
    assert found.units[-1].module_fqns == ("",) and found.units[-1].kind == "kept"


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_negative_control_inspecting_a_weight_is_no_use(observed: bool) -> None:
    # isinstance and .dtype work on a sharded parameter: neither means is fooled into a refusal
    found = layout(InspectingRoot(), observed=observed)
    assert found.owner["decoder.norm.weight"] == "decoder"


@pytest.mark.parametrize("observed", [False, True], ids=["source", "observed"])
def test_frozen_root_tokens_leave_the_read_module_in_the_root_unit(observed: bool) -> None:
    # No FP32 root unit, no children split out of it: the read weight is the root unit's,
    # gathered in the root's own forward before the read.
    model = HeadReadingRoot()
    model.query_tokens.requires_grad_(False)
    found = layout(model, observed=observed)
    assert found.owner["decoder.head.weight"] == "<root>"
    assert found.replicated == ("query_tokens",)
    assert found.units[-1].kind == "root"


class _Assigning(nn.Module):
    """Writes and deletes attributes of its children in forward; reads only ``bias`` and
    ``scale.weight`` (``+=`` reads before it writes)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - parsed, not run
        self.decoder.bias = self.bias
        del self.cache.weight
        self.scale.weight += 1
        return h


def test_an_assignment_or_deletion_is_not_a_read() -> None:
    chains = {chain for _, chain, _, _ in source._methods(_Assigning)["forward"].chains}
    assert ("decoder", "bias") not in chains
    assert ("cache", "weight") not in chains
    assert {("bias",), ("scale", "weight")} <= chains, chains
