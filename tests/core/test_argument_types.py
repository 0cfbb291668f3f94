"""Wrong-typed arguments to the public API are refused at the call, naming the parameter and
the fix, with an ``Fp32KeepTypeError``, before anything is changed.

They used to reach the first use of the value: ``resolve_keep_plan(None, ...)`` raised
``vars() argument must have __dict__ attribute`` (from reading the keep declarations),
``wrap="Block"`` became the class names ``B``, ``l``, ``o``, ``c``, ``k``, ``wrap=3`` raised
``'int' object is not iterable``, and ``observe_parameter_use(42)`` raised nothing until its
``with`` block. Single process: these are refused before any process group is looked for (the
loader's, which must be agreed by every rank, are in
tests/multirank/test_load_refusals_fsdp2.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import fp32keep
from fp32keep import Fp32KeepRuntimeError, Fp32KeepTypeError
from tests.core.toys import SEMANTICS, stack_class
from tests.error_bounds import LIBRARY_BOUND_S, within
from tests.untouched import assert_same_parameters, snapshot

BF16 = torch.bfloat16
POLICY = MixedPrecisionPolicy(param_dtype=BF16)


def _stack() -> torch.nn.Module:
    torch.manual_seed(0)
    return stack_class(strict=["wo"])()


def _layout(wrap: object) -> Callable[[torch.nn.Module], object]:
    def call(model: torch.nn.Module) -> object:
        plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
        fp32keep.keep_aware_cast(model, BF16, plan=plan)
        return fp32keep.plan_layout(model, plan, wrap=wrap)  # type: ignore[arg-type]

    return call


def _apply(wrap: object) -> Callable[[torch.nn.Module], object]:
    # mesh=None and no process group: both refusals come later than the argument types
    return lambda model: fp32keep.apply_fsdp2(
        model,
        mesh=None,  # type: ignore[arg-type]
        mp_policy=POLICY,
        wrap=wrap,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("case", "call", "match"),
    [
        pytest.param(
            "wrap-a-string",
            _layout("Block"),
            r"wrap must be a list .* got the string 'Block'; pass wrap=\['Block'\]",
            id="wrap-a-string",
        ),
        pytest.param(
            "apply-wrap-a-string",
            _apply("Block"),
            r"got the string 'Block'; pass wrap=\['Block'\]",
            id="apply-wrap-a-string",
        ),
        pytest.param(
            "wrap-an-int",
            _layout(3),
            r"wrap must be a list of module classes .*, or a predicate "
            r"callable\(module\) -> bool, got int 3",
            id="wrap-an-int",
        ),
        pytest.param(
            "wrap-a-dict",
            _layout({"Block": 1}),
            r"wrap must be .* got dict \{'Block': 1\}",
            id="wrap-a-dict",
        ),
        pytest.param(
            "resolve-none",
            lambda _: fp32keep.resolve_keep_plan(None, BF16),  # type: ignore[arg-type]
            r"resolve_keep_plan: model must be a torch\.nn\.Module, got None of type NoneType; "
            r"pass the model itself",
            id="resolve-none",
        ),
        pytest.param(
            "resolve-a-path",
            lambda _: fp32keep.resolve_keep_plan("/ckpt/llama", BF16),  # type: ignore[arg-type]
            r"got '/ckpt/llama' of type str \(a checkpoint path\? build the model first",
            id="resolve-a-path",
        ),
        pytest.param(
            "cast-none",
            lambda _: fp32keep.keep_aware_cast(None, BF16),  # type: ignore[arg-type]
            r"keep_aware_cast: model must be a torch\.nn\.Module, got None",
            id="cast-none",
        ),
        pytest.param(
            "upcast-none",
            lambda _: fp32keep.upcast_to_fp32_master(None),  # type: ignore[arg-type]
            r"upcast_to_fp32_master: model must be a torch\.nn\.Module",
            id="upcast-none",
        ),
        pytest.param(
            "observe-42",
            lambda _: fp32keep.observe_parameter_use(42),  # type: ignore[arg-type]  # no `with`
            r"observe_parameter_use: model must be a torch\.nn\.Module, got 42 of type int",
            id="observe-42",
        ),
        pytest.param(
            "layout-none",
            lambda model: fp32keep.plan_layout(None, fp32keep.resolve_keep_plan(model, BF16)),  # type: ignore[arg-type]
            r"plan_layout: model must be a torch\.nn\.Module",
            id="layout-none",
        ),
        pytest.param(
            "apply-none",
            lambda _: fp32keep.apply_fsdp2(None, mesh=None, mp_policy=POLICY),  # type: ignore[arg-type]
            r"apply_fsdp2: model must be a torch\.nn\.Module",
            id="apply-none",
        ),
        pytest.param(
            "sharded-layout-42",
            lambda _: fp32keep.sharded_layout(42),  # type: ignore[arg-type]
            r"sharded_layout: model must be a torch\.nn\.Module",
            id="sharded-layout-42",
        ),
        pytest.param(
            "gather-42",
            lambda _: fp32keep.gather_full_state_dict(42),  # type: ignore[arg-type]
            r"gather_full_state_dict: model must be a torch\.nn\.Module",
            id="gather-42",
        ),
    ],
)
def test_a_wrong_typed_argument_is_refused_naming_it_and_the_fix(
    case: str, call: Callable[[torch.nn.Module], object], match: str
) -> None:
    assert not dist.is_initialized()
    model = _stack()
    before = snapshot(model)
    with within(LIBRARY_BOUND_S), pytest.raises(Fp32KeepTypeError, match=match):
        call(model)
    assert not any(isinstance(module, FSDPModule) for module in model.modules())
    if not case.startswith("wrap-"):  # those cast first, on purpose: the layout needs it
        assert_same_parameters(model, before)


@pytest.mark.parametrize(
    "wrap",
    [["Block"], ("Block",), {"Block"}, None, lambda module: False],
    # a predicate's repr holds its address, which differs between xdist workers
    ids=["list", "tuple", "set", "None", "predicate"],
)
def test_the_right_types_pass_the_same_checks(wrap: object) -> None:
    """Control: the checks refuse the type, not every value: a list (tuple, set) of class
    names, None and a predicate lay out; ``apply_fsdp2`` then meets the missing process group."""
    model = _stack()
    assert isinstance(_layout(wrap)(model), fp32keep.Layout)
    with pytest.raises(Fp32KeepRuntimeError, match="needs an initialised process group"):
        _apply(wrap)(_stack())
    with fp32keep.observe_parameter_use(_stack()) as observed:
        pass
    assert isinstance(observed, fp32keep.ParameterUse)
