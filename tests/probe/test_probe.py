"""Single-process tests of ``DtypeProbe``: the three observations, kept apart.

Each scenario is built so that at least two of the observations (activation boundary,
materialised parameters, operators) differ; a probe that conflated them would fail it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from pytest_fp32keep.contract.probe import (
    BoundaryMismatch,
    DtypeProbe,
    OpDtypes,
    diff_boundaries,
    format_mismatches,
)

BF16, FP32 = torch.bfloat16, torch.float32


class Inkling(nn.Module):
    """Records its input dtype, computes in FP32 (autocast off), casts back to the input dtype."""

    def __init__(self, weight_dtype: torch.dtype = FP32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=weight_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        with torch.autocast("cpu", enabled=False):
            y = F.linear(x.to(FP32), self.weight.to(FP32))
        return y.to(input_dtype)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.conv = Inkling()
        self.outer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.conv(self.inner(x)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_leaked_dispatch_mode() -> Iterator[None]:
    # Every test must leave the thread's dispatch-mode stack as it found it.
    assert _get_current_dispatch_mode() is None
    yield
    assert _get_current_dispatch_mode() is None


def ops_named(ops: list[OpDtypes], name: str) -> list[OpDtypes]:
    return [op for op in ops if op.op == name]


# --------------------------------------------------------------------- the three observations


def test_bf16_weight_fp32_op_inkling_keeps_observations_apart() -> None:
    # Weight stored (and materialised) bf16, activation bf16, but the matmul runs in FP32 after
    # the module's explicit casts: a weight-dtype hook would call this a bf16 computation.
    model = Inkling(weight_dtype=BF16)
    x = torch.randn(2, 4, dtype=BF16)
    with DtypeProbe(model) as probe:
        model(x)
    assert probe.boundary_dtypes("") == ({"args[0]": BF16}, {"output": BF16})
    assert probe.materialized_dtypes("") == {"weight": BF16}
    ops = probe.op_dtypes("")
    assert ops_named(ops, "aten.mm.default") == [OpDtypes("aten.mm.default", (FP32, FP32), (FP32,))]
    # The two upcasts and the cast back are the module's own operators.
    casts = ops_named(ops, "aten._to_copy.default")
    assert [(c.inputs, c.outputs) for c in casts] == [
        ((BF16,), (FP32,)),
        ((BF16,), (FP32,)),
        ((FP32,), (BF16,)),
    ]


def test_fp32_kept_inkling_has_bf16_boundary_fp32_params_fp32_ops() -> None:
    model = Stack().to(BF16)
    model.conv.to(FP32)  # the keep-aware cast by hand
    with DtypeProbe(model) as probe:
        model(torch.randn(2, 4, dtype=BF16))
    assert probe.boundary_dtypes("conv") == ({"args[0]": BF16}, {"output": BF16})
    assert probe.materialized_dtypes("conv") == {"weight": FP32}
    assert probe.materialized_dtypes("inner") == {"weight": BF16, "bias": BF16}
    (mm,) = ops_named(probe.op_dtypes("conv"), "aten.mm.default")
    assert mm.inputs == (FP32, FP32)
    # Operators are attributed to the innermost module: the Linear ops are not conv's.
    assert not ops_named(probe.op_dtypes("conv"), "aten.addmm.default")
    (addmm,) = ops_named(probe.op_dtypes("inner"), "aten.addmm.default")
    assert addmm.outputs == (BF16,)


def test_autocast_operators_are_seen_after_autocast() -> None:
    # FP32 weight and FP32 activation at the boundary; autocast runs above Python dispatch, so
    # the probe sees the bf16 matmul that actually executed.
    model = nn.Linear(4, 4)
    with DtypeProbe(model) as probe, torch.autocast("cpu", dtype=BF16):
        model(torch.randn(2, 4))
    assert probe.boundary_dtypes("") == ({"args[0]": FP32}, {"output": BF16})
    assert probe.materialized_dtypes("") == {"weight": FP32, "bias": FP32}
    (addmm,) = ops_named(probe.op_dtypes(""), "aten.addmm.default")
    assert addmm.inputs == (BF16, BF16, BF16)
    assert addmm.outputs == (BF16,)


def test_autocast_inside_inkling_compute_stays_fp32() -> None:
    model = Stack()
    with DtypeProbe(model) as probe, torch.autocast("cpu", dtype=BF16):
        model(torch.randn(2, 4))
    # inner's output is bf16 under autocast, so conv receives bf16 and returns bf16 ...
    assert probe.boundary_dtypes("conv") == ({"args[0]": BF16}, {"output": BF16})
    # ... while its matmul ran in FP32 because it turns autocast off.
    (mm,) = ops_named(probe.op_dtypes("conv"), "aten.mm.default")
    assert mm.outputs == (FP32,)


def test_direct_bf16_everything_bf16() -> None:
    model = Stack().to(BF16)
    model.conv = Inkling(weight_dtype=BF16)
    with DtypeProbe(model) as probe:
        model(torch.randn(2, 4, dtype=BF16))
    for fqn in ("inner", "outer"):
        assert probe.boundary_dtypes(fqn) == ({"args[0]": BF16}, {"output": BF16})
        assert set(probe.materialized_dtypes(fqn).values()) == {BF16}
        assert {d for op in probe.op_dtypes(fqn) for d in op.outputs} == {BF16}


# --------------------------------------------------------------------- hook ordering


def test_inputs_seen_after_a_prepended_cast_hook_registered_later() -> None:
    # What FSDP2 does with cast_forward_inputs: a pre-hook registered with prepend=True after
    # the probe attached. The probe must report what forward receives.
    model = Inkling()
    with DtypeProbe(model) as probe:
        model.register_forward_pre_hook(lambda m, args: (args[0].to(BF16),), prepend=True)
        model(torch.randn(2, 4))
    assert probe.boundary_dtypes("").inputs == {"args[0]": BF16}


def test_outputs_seen_after_a_cast_hook_registered_later() -> None:
    # What FSDP2 does with output_dtype: a forward hook appended after the probe attached
    # (fully_shard after attach). The probe must still report what the caller receives.
    model = Inkling()
    x = torch.randn(2, 4, dtype=BF16)
    with DtypeProbe(model) as probe:
        model.register_forward_hook(lambda m, args, out: out.to(FP32))
        for _ in range(2):
            model(x)
    assert probe.boundary_dtypes("", call=0).outputs == {"output": FP32}
    assert probe.boundary_dtypes("", call=1).outputs == {"output": FP32}
    # The cast ran in a hook, not in forward: it is attributed to the "hooks" phase.
    hook_ops = probe.op_dtypes("", call=0, phase="hooks")
    assert hook_ops == [OpDtypes("aten._to_copy.default", (BF16,), (FP32,))]
    assert OpDtypes("aten._to_copy.default", (BF16,), (FP32,)) in probe.op_dtypes("", call=0)


# --------------------------------------------------------------------- numerics untouched


def _graph_signature(tensor: torch.Tensor) -> list[str]:
    seen: list[str] = []
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        seen.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("autocast", [False, True], ids=["direct", "autocast"])
def test_probe_does_not_change_numerics_or_autograd_graph(autocast: bool) -> None:
    def run(probed: bool) -> tuple[torch.Tensor, list[str], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = Stack().to(BF16)
        model.conv.to(FP32)
        x = torch.randn(3, 4, dtype=BF16)
        probe = DtypeProbe(model)
        if probed:
            probe.attach()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = model(x)
        out.float().square().sum().backward()
        probe.detach()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return out, _graph_signature(out), grads

    plain_out, plain_graph, plain_grads = run(probed=False)
    probed_out, probed_graph, probed_grads = run(probed=True)
    assert torch.equal(plain_out, probed_out)
    assert plain_out.dtype == probed_out.dtype
    assert plain_graph == probed_graph
    assert plain_grads.keys() == probed_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.equal(grad, probed_grads[name]), name


# --------------------------------------------------------------------- structure and calls


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Nested(nn.Module):
    def forward(
        self, x: torch.Tensor, *, extras: dict[str, Any], mask: torch.Tensor
    ) -> dict[str, Any]:
        a, b = extras["pair"]
        return {"sum": x + a.float(), "pair": Pair(b, x.half()), "count": mask.sum()}


def test_nested_args_kwargs_and_outputs_have_paths_and_skip_integers() -> None:
    model = Nested()
    with DtypeProbe(model) as probe:
        model(
            torch.ones(2),
            extras={
                "pair": (torch.ones(2, dtype=BF16), torch.ones(2, dtype=torch.float64)),
                "note": "text",
            },
            mask=torch.ones(2, dtype=torch.int64),
        )
    inputs, outputs = probe.boundary_dtypes("")
    assert inputs == {
        "args[0]": FP32,
        "kwargs['extras']['pair'][0]": BF16,
        "kwargs['extras']['pair'][1]": torch.float64,
    }
    assert outputs == {
        "output['sum']": FP32,
        "output['pair'].first": torch.float64,
        "output['pair'].second": torch.float16,
    }
    record = probe.boundary("")
    assert record.module_type == "Nested"
    assert [leaf.shape for leaf in record.inputs] == [(2,), (2,), (2,)]


def test_each_call_is_recorded_separately() -> None:
    model = Inkling()
    with DtypeProbe(model) as probe:
        model(torch.randn(2, 4, dtype=BF16))
        model(torch.randn(2, 4, dtype=torch.float16))
    assert probe.calls("") == 2
    assert probe.boundary_dtypes("", call=0).inputs == {"args[0]": BF16}
    assert probe.boundary_dtypes("", call=1).inputs == {"args[0]": torch.float16}
    assert probe.boundary_dtypes("") == probe.boundary_dtypes("", call=1)  # -1: the latest
    assert {op.call for op in probe.op_records} == {0, 1}
    with pytest.raises(IndexError, match="2 recorded forward call"):
        probe.boundary_dtypes("", call=2)


def test_shared_module_called_twice_in_one_forward() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.layer(x).to(BF16).float())

    model = Twice()
    with DtypeProbe(model, modules=["layer"]) as probe:
        model(torch.randn(2, 4))
    assert probe.calls("layer") == 2
    assert [r.call for r in probe.param_records] == [0, 0, 1, 1]
    # The parent is not probed: its bf16 round trip is attributed to no module.
    assert {op.fqn for op in probe.op_records} == {"layer"}


# --------------------------------------------------------------------- selection and lifecycle


def test_module_selection_by_fqns_predicate_and_string() -> None:
    model = Stack()
    assert DtypeProbe(model, modules=["conv", "inner"]).modules == ("inner", "conv")
    assert DtypeProbe(model, modules="conv").modules == ("conv",)
    linear_only = DtypeProbe(model, modules=lambda fqn, m: isinstance(m, nn.Linear))
    assert linear_only.modules == ("inner", "outer")
    assert DtypeProbe(model).modules == ("", "inner", "conv", "outer")
    with pytest.raises(ValueError, match=r"no module named \['nope'\]"):
        DtypeProbe(model, modules=["conv", "nope"])
    with pytest.raises(ValueError, match="selects no module"):
        DtypeProbe(model, modules=lambda fqn, m: False)
    with pytest.raises(TypeError, match=r"needs an nn\.Module"):
        DtypeProbe(lambda x: x)  # type: ignore[arg-type]


def test_ops_of_unprobed_children_go_to_the_nearest_probed_ancestor() -> None:
    model = Stack()
    with DtypeProbe(model, modules=[""]) as probe:
        model(torch.randn(2, 4))
    ops = probe.op_dtypes("")
    assert len(ops_named(ops, "aten.addmm.default")) == 2
    assert len(ops_named(ops, "aten.mm.default")) == 1


def test_detach_removes_every_hook_and_keeps_records() -> None:
    from torch.nn.modules import module as module_globals

    model = Stack()
    global_pre = dict(module_globals._global_forward_pre_hooks)
    global_post = dict(module_globals._global_forward_hooks)
    x = torch.randn(2, 4, requires_grad=False)
    probe = DtypeProbe(model)
    with probe:
        assert probe.attached
        model(x).sum().backward()
    assert not probe.attached
    for module in model.modules():
        assert not module._forward_pre_hooks
        assert not module._forward_hooks
    for param in model.parameters():
        assert not param._backward_hooks
    assert dict(module_globals._global_forward_pre_hooks) == global_pre
    assert dict(module_globals._global_forward_hooks) == global_post
    before = (probe.boundary_records, probe.op_records, probe.grad_records)
    model(x).sum().backward()
    assert (probe.boundary_records, probe.op_records, probe.grad_records) == before
    assert probe.calls("conv") == 1
    probe.detach()  # idempotent
    probe.attach()
    with pytest.raises(RuntimeError, match="already attached"):
        probe.attach()
    model(x)
    probe.detach()
    assert probe.calls("conv") == 2
    probe.clear()
    assert probe.calls("conv") == 0
    assert not probe.boundary_records


def test_forward_that_raises_is_recorded_and_leaves_no_state() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inner(x)
            raise RuntimeError("boom")

    model = Boom()
    with DtypeProbe(model) as probe:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))
        # The stack unwound and the dispatch mode was left, so the next call is normal.
        model.inner(torch.randn(2, 4, dtype=torch.float64).float())
    root = probe.boundary("")
    assert not root.completed
    assert root.outputs == ()
    assert probe.boundary("inner", call=0).completed
    assert probe.calls("inner") == 2
    assert {op.fqn for op in probe.op_records if op.call == 1} == {"inner"}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpoint_recomputation_is_an_extra_call(use_reentrant: bool) -> None:
    model = Stack()

    def forward(x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(model.inner, x, use_reentrant=use_reentrant)
        return model.outer(hidden)

    x = torch.randn(2, 4, requires_grad=True)
    with DtypeProbe(model, modules=["inner", "outer"]) as probe:
        forward(x).sum().backward()
    assert probe.calls("inner") == 2
    assert probe.calls("outer") == 1
    assert probe.grad_dtypes("inner") == {"weight": FP32, "bias": FP32}


def test_two_probes_on_the_same_module_both_record() -> None:
    model = Stack()
    with DtypeProbe(model) as first, DtypeProbe(model, modules=["conv"]) as second:
        model(torch.randn(2, 4))
    assert first.op_dtypes("conv") == second.op_dtypes("conv")
    assert first.op_dtypes("conv")


def test_deep_copy_of_a_probed_model_is_not_recorded() -> None:
    model = Stack()
    with DtypeProbe(model) as probe:
        clone = copy.deepcopy(model)
        clone(torch.randn(2, 4))
        assert not probe.boundary_records
        model(torch.randn(2, 4))
    assert probe.calls("conv") == 1


# --------------------------------------------------------------------- gradients


def test_gradient_dtypes_are_a_separate_observation() -> None:
    model = Stack().to(BF16)
    model.conv.to(FP32)
    with DtypeProbe(model) as probe:
        model(torch.randn(2, 4, dtype=BF16)).float().sum().backward()
    assert probe.grad_dtypes("conv") == {"weight": FP32}
    assert probe.grad_dtypes("inner") == {"weight": BF16, "bias": BF16}
    assert probe.grad_dtypes("") == {}
    # A second forward reuses the hook on the same parameter object: one record per backward.
    with probe:
        model(torch.randn(2, 4, dtype=BF16)).float().sum().backward()
    assert len([g for g in probe.grad_records if g.fqn == "conv"]) == 2


def test_record_ops_and_grads_can_be_turned_off() -> None:
    model = Stack()
    with DtypeProbe(model, record_ops=False, record_grads=False) as probe:
        model(torch.randn(2, 4)).sum().backward()
    assert not probe.op_records
    assert not probe.grad_records
    assert probe.materialized_dtypes("conv") == {"weight": FP32}


# --------------------------------------------------------------------- reports and diffs


def test_to_dict_is_json_and_tables_name_every_observation() -> None:
    model = Stack().to(BF16)
    model.conv.to(FP32)
    with DtypeProbe(model) as probe:
        model(torch.randn(2, 4, dtype=BF16)).float().sum().backward()
    data = json.loads(json.dumps(probe.to_dict()))
    assert data["calls"] == {"": 1, "inner": 1, "conv": 1, "outer": 1}
    conv_params = [p for p in data["materialized_params"] if p["fqn"] == "conv"]
    assert conv_params == [
        {
            "fqn": "conv",
            "call": 0,
            "name": "weight",
            "dtype": "float32",
            "shape": [4, 4],
            "sharded": False,
        }
    ]
    summary = probe.summary()
    conv_row = next(line for line in summary.splitlines() if line.startswith("conv "))
    assert "args[0]=bf16" in conv_row
    assert "weight=fp32" in conv_row
    assert "mm->fp32x1" in conv_row
    assert "(root)" in summary
    assert "aten.mm.default" in probe.as_table("ops")
    assert "float32" in probe.as_table("params")
    assert "output" in probe.as_table("boundary")
    assert "weight" in probe.as_table("grads")
    with pytest.raises(ValueError, match="kind must be"):
        probe.as_table("nope")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="does not probe module 'nope'"):
        probe.boundary_dtypes("nope")


def _boundary_run(child_input_dtype: torch.dtype) -> DtypeProbe:
    model = Stack()
    # A stand-in for an FSDP2 unit's cast_forward_inputs on the child.
    model.conv.register_forward_pre_hook(lambda m, args: (args[0].to(child_input_dtype),))
    with DtypeProbe(model) as probe, torch.autocast("cpu", dtype=BF16):
        model(torch.randn(2, 4))
    return probe


def test_diff_boundaries_names_module_call_path_and_dtypes() -> None:
    reference = _boundary_run(BF16)
    assert diff_boundaries(reference, _boundary_run(BF16)) == []
    assert format_mismatches([]) == "no mismatches"
    mismatches = diff_boundaries(reference, _boundary_run(FP32))
    assert mismatches == [
        BoundaryMismatch("conv", 0, "input", "args[0]", BF16, FP32),
        BoundaryMismatch("conv", 0, "output", "output", BF16, FP32),
        BoundaryMismatch("outer", 0, "input", "args[0]", BF16, FP32),
    ]
    assert str(mismatches[0]) == "conv call 0 input args[0]: expected bfloat16, observed float32"
    table = format_mismatches(mismatches)
    assert table.splitlines()[0].split() == [
        "module",
        "call",
        "direction",
        "path",
        "expected",
        "observed",
    ]
    assert json.dumps([m.to_dict() for m in mismatches])
    # Restricting to modules, and comparing raw records, work the same way.
    only_conv = diff_boundaries(reference.boundary_records, _boundary_run(FP32), modules=["conv"])
    assert [m.fqn for m in only_conv] == ["conv", "conv"]


def test_diff_boundaries_reports_calls_and_leaves_missing_on_one_side() -> None:
    model = Inkling()
    with DtypeProbe(model) as reference:
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    with DtypeProbe(model) as observed:
        model(torch.randn(2, 4))
    assert diff_boundaries(reference, observed) == [
        BoundaryMismatch("", 1, "input", "args[0]", FP32, None),
        BoundaryMismatch("", 1, "output", "output", FP32, None),
    ]
    assert "expected float32, observed -" in str(diff_boundaries(reference, observed)[0])


# --------------------------------------------------------------------- Hugging Face


def test_hugging_face_model_under_autocast() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 32, (1, 5))
    with DtypeProbe(model) as probe:
        with torch.autocast("cpu", dtype=BF16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    q_proj = "model.layers.0.self_attn.q_proj"
    # RMSNorm hands q_proj an FP32 activation; its weight is FP32; its matmul ran in bf16.
    assert probe.boundary_dtypes(q_proj) == ({"args[0]": FP32}, {"output": BF16})
    assert probe.materialized_dtypes(q_proj) == {"weight": FP32}
    assert ops_named(probe.op_dtypes(q_proj), "aten.mm.default") == [
        OpDtypes("aten.mm.default", (BF16, BF16), (BF16,))
    ]
    assert probe.grad_dtypes(q_proj) == {"weight": FP32}
    # Keyword arguments and ModelOutput fields are walked with their paths.
    attention_inputs = probe.boundary_dtypes("model.layers.0.self_attn").inputs
    assert attention_inputs["kwargs['position_embeddings'][0]"] == FP32
    assert probe.boundary_dtypes("").outputs == {"output['loss']": FP32, "output['logits']": BF16}
    assert probe.boundary_dtypes("").inputs == {}  # input_ids and labels are integers
