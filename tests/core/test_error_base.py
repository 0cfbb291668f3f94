"""Every error fp32keep raises is an ``Fp32KeepError`` and still the built-in it always was.

Two halves: a static reading of every ``raise`` in ``impl/fp32keep`` (a new ``raise
ValueError(...)`` fails here, whichever call reaches it), and real bad calls, each caught as
``Fp32KeepError`` and as its built-in. Single process: the calls that need a process group are
refused before they look for one, or are the refusal for its absence.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep
from fp32keep import (
    Fp32KeepError,
    Fp32KeepNotImplementedError,
    Fp32KeepRuntimeError,
    Fp32KeepTypeError,
    Fp32KeepValueError,
    KeepDeclarationError,
    KeepLayoutError,
    KeepPlanError,
    StateDictError,
)
from fp32keep._torch.fsdp_hooks import FsdpHooksError
from fp32keep.shard.apply import observation_refusal
from tests.core.toys import SEMANTICS, model_with_names, stack_class
from tests.error_bounds import LIBRARY_BOUND_S, within

LIBRARY = Path(fp32keep.__file__).resolve().parent
FP16, BF16 = torch.float16, torch.bfloat16


# --- every raise in the library's source -------------------------------------------------------


def _resolve(expression: ast.expr, namespace: dict[str, object]) -> object | None:
    """The class (or the function whose result) a ``raise`` names, from the module's globals
    or the builtins; ``None`` for a local (``raise error``, ``raise kind(message)``: typed
    ``Fp32KeepError`` by mypy)."""
    target = expression.func if isinstance(expression, ast.Call) else expression
    try:
        return eval(ast.unparse(target), {**vars(builtins), **namespace})
    except (NameError, AttributeError):
        return None


def _protocol_raises(tree: ast.AST) -> set[int]:
    """The ``raise`` nodes inside dunder methods: Python's protocols fix what they raise
    (``__setattr__`` of an immutable object: an ``AttributeError``)."""
    return {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        and function.name.startswith("__")
        and function.name.endswith("__")
        for node in ast.walk(function)
        if isinstance(node, ast.Raise)
    }


def foreign_raises(source: str, namespace: dict[str, object]) -> list[str]:
    """``line: expression`` for each ``raise`` of a class that is not an ``Fp32KeepError``.

    Allowed besides: ``AssertionError`` (an invariant, a bug if it fires), a private class the
    same source catches (``_Uncomparable``: never leaves the module), what a dunder method
    raises (:func:`_protocol_raises`), and a function's result when it is annotated to return
    an ``Fp32KeepError`` (``raise observation_refusal(...)``).
    """
    found: list[str] = []
    tree = ast.parse(source)
    protocol = _protocol_raises(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None or id(node) in protocol:
            continue
        raised = _resolve(node.exc, namespace)
        if inspect.isfunction(raised) and isinstance(node.exc, ast.Call):
            raised = typing.get_type_hints(raised).get("return")
        if raised is None or raised is AssertionError:
            continue
        if isinstance(raised, type) and issubclass(raised, Fp32KeepError):
            continue
        name = getattr(raised, "__name__", "")
        if name.startswith("_") and f"except {name}" in source:
            continue
        found.append(f"{node.lineno}: {ast.unparse(node.exc)[:60]}")
    return found


def _module(path: Path) -> str:
    """``fp32keep.layout.planning`` for ``impl/fp32keep/layout/planning.py`` (packages too)."""
    parts = path.relative_to(LIBRARY).with_suffix("").parts
    return ".".join(("fp32keep", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_every_raise_in_the_library_is_an_fp32keep_error() -> None:
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 20  # the real library, not an empty folder
    offences = {
        str(path.relative_to(LIBRARY)): found
        for path in modules
        if (
            found := foreign_raises(
                path.read_text(encoding="utf-8"), vars(importlib.import_module(_module(path)))
            )
        )
    }
    assert offences == {}, "raise an fp32keep.errors class (Fp32KeepValueError, ...) instead"


def test_the_raise_reader_catches_a_builtin() -> None:
    """Negative control: a bare built-in, an imported foreign class, a private class that
    escapes are all seen; the library's own classes, invariants and locals are not."""
    source = (
        "def f(kind, error):\n"
        "    raise ValueError('x')\n"
        "    raise OSError\n"
        "    raise Escapes('y')\n"
        "    raise Fp32KeepValueError('fine')\n"
        "    raise AssertionError('invariant')\n"
        "    raise kind('local')\n"
        "    raise error\n"
        "    raise refusal()\n"
        "    raise helper()\n"
        "class C:\n"
        "    def __setattr__(self, name, value):\n"
        "        raise AttributeError(name)\n"
    )
    escapes = type("Escapes", (Exception,), {})

    def refusal() -> Fp32KeepError:
        return Fp32KeepValueError("built")

    def helper() -> ValueError:
        return ValueError("built")

    namespace = {
        "Fp32KeepValueError": Fp32KeepValueError,
        "Escapes": escapes,
        "refusal": refusal,
        "helper": helper,
    }
    found = foreign_raises(source, namespace)
    assert [line.split(":")[0] for line in found] == ["2", "3", "4", "10"]


# --- real bad calls ----------------------------------------------------------------------------


def _t5_like() -> torch.nn.Module:
    return model_with_names(["a.wo.weight", "a.x.weight"], strict=["wo"])


def _bad_cast_dtype(dtype: object) -> Callable[[], object]:
    return lambda: fp32keep.keep_aware_cast(_t5_like(), dtype)  # type: ignore[arg-type]


def _plan_for_another_dtype() -> object:
    model = stack_class(regular=["wo"])()
    plan = fp32keep.resolve_keep_plan(model, FP16, transformers_version=SEMANTICS)
    return fp32keep.keep_aware_cast(model, BF16, plan=plan)


def _plan_of_another_model() -> object:
    plan = fp32keep.resolve_keep_plan(_t5_like(), FP16)
    return fp32keep.keep_aware_cast(model_with_names(["b.y.weight"]), FP16, plan=plan)


def _layout(**options: object) -> Callable[[], object]:
    def call() -> object:
        model = stack_class(strict=["wo"])()
        plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
        if not options:  # a kept weight degraded by a plain cast
            model.to(BF16)
        return fp32keep.plan_layout(model, plan, **options)  # type: ignore[arg-type]

    return call


def _mixed_storage() -> object:
    model = model_with_names(["a.weight", "b.weight"])
    model.a.half()
    model.b.bfloat16()
    return fp32keep.infer_low_precision_dtype(model, MixedPrecisionPolicy())


def _load_without_a_process_group() -> object:
    # The loader's placement refusal (Fp32KeepNotImplementedError) needs a mesh, so ranks:
    # docs/errors.md C5, tests/multirank/test_load_meshes_fsdp2.py.
    return fp32keep.load_full_state_dict(stack_class()(), None)


@pytest.mark.parametrize(
    ("call", "error_class", "builtin"),
    [
        pytest.param(_bad_cast_dtype("bf16"), Fp32KeepTypeError, TypeError, id="dtype-not-a-dtype"),
        pytest.param(_bad_cast_dtype(torch.int32), Fp32KeepValueError, ValueError, id="int-dtype"),
        pytest.param(_plan_for_another_dtype, KeepPlanError, ValueError, id="plan-other-dtype"),
        pytest.param(_plan_of_another_model, KeepPlanError, ValueError, id="plan-other-model"),
        pytest.param(
            lambda: fp32keep.resolve_keep_plan(
                model_with_names(["a.wo.weight"], regular="wo"), BF16
            ),
            KeepDeclarationError,
            ValueError,
            id="bare-string-declaration",
        ),
        pytest.param(_layout(), KeepLayoutError, ValueError, id="degraded-layout"),
        pytest.param(_layout(wrap=[3]), Fp32KeepTypeError, TypeError, id="wrap-not-a-class"),
        pytest.param(_layout(wrap=["NoSuch"]), Fp32KeepValueError, ValueError, id="wrap-unknown"),
        pytest.param(_layout(group_kept="x"), Fp32KeepValueError, ValueError, id="group-kept"),
        pytest.param(_mixed_storage, Fp32KeepValueError, ValueError, id="mixed-storage"),
        pytest.param(
            lambda: fp32keep.observe_parameter_use(object()).__enter__(),  # type: ignore[arg-type]
            Fp32KeepTypeError,
            TypeError,
            id="observe-not-a-module",
        ),
        pytest.param(
            lambda: fp32keep.apply_fsdp2(
                stack_class()(),
                mesh=None,  # type: ignore[arg-type]
                mp_policy=MixedPrecisionPolicy(),
            ),
            Fp32KeepRuntimeError,
            RuntimeError,
            id="apply-without-process-group",
        ),
        pytest.param(
            _load_without_a_process_group, Fp32KeepRuntimeError, RuntimeError, id="load-no-pg"
        ),
        pytest.param(
            lambda: fp32keep.register_gathered_methods(
                stack_class()(), [("",)], {"": ("forward",)}
            ),
            Fp32KeepTypeError,
            TypeError,
            id="gather-unsharded",
        ),
    ],
)
def test_every_library_error_is_an_fp32keep_error(
    call: Callable[[], object], error_class: type[Fp32KeepError], builtin: type[Exception]
) -> None:
    assert not dist.is_initialized()  # the process-group refusals must be the ones we meet
    with within(LIBRARY_BOUND_S), pytest.raises(Fp32KeepError) as raised:
        call()
    assert type(raised.value) is error_class, raised.value
    assert isinstance(raised.value, builtin)  # an `except ValueError` written earlier still works


def test_the_kinds_and_their_builtins() -> None:
    """The tree ``except`` clauses rely on; written out, not read from the classes' code."""
    expected = {
        Fp32KeepValueError: ValueError,
        Fp32KeepTypeError: TypeError,
        Fp32KeepRuntimeError: RuntimeError,
        Fp32KeepNotImplementedError: NotImplementedError,
        KeepDeclarationError: ValueError,
        KeepLayoutError: ValueError,
        KeepPlanError: ValueError,
        StateDictError: ValueError,
        FsdpHooksError: RuntimeError,
    }
    for error_class, builtin in expected.items():
        assert issubclass(error_class, Fp32KeepError), error_class
        assert issubclass(error_class, builtin), error_class
    assert "Fp32KeepError" in fp32keep.__all__


# --- the observation refusal's kind is data, not wording ----------------------------------------


def sniffed_kind(texts: list[str]) -> type[Exception]:
    """The rule this replaced, kept here as the known-wrong implementation."""
    return TypeError if any("must be a" in text for text in texts) else ValueError


#: Problems whose wording misleads a reader of the text: a value problem saying "must be a",
#: a type problem that does not.
MISLEADING = [
    (1, (Fp32KeepValueError, "its parameter must be a DTensor-free copy: observe unsharded")),
    (0, (Fp32KeepTypeError, "observed is a str, not a fp32keep.ParameterUse")),
]


@pytest.mark.parametrize(
    ("refusals", "expected"),
    [
        pytest.param(MISLEADING[:1], Fp32KeepValueError, id="value-saying-must-be-a"),
        pytest.param(MISLEADING[1:], Fp32KeepTypeError, id="type-without-must-be-a"),
        pytest.param(MISLEADING, Fp32KeepTypeError, id="any-type-wins"),
    ],
)
def test_the_observation_refusal_kind_comes_from_the_problems_kinds(
    refusals: list[tuple[int, tuple[type[Fp32KeepError], str]]], expected: type[Fp32KeepError]
) -> None:
    error = observation_refusal(refusals)
    assert type(error) is expected
    for rank, (_, text) in refusals:
        assert f"rank {rank}: {text}" in str(error)


def test_the_misleading_problems_fool_the_message_search() -> None:
    """Negative control: the inputs above discriminate; the old rule got both single cases
    wrong, so a kind read back out of the text would fail the test above."""
    assert sniffed_kind([MISLEADING[0][1][1]]) is TypeError  # should be a ValueError
    assert sniffed_kind([MISLEADING[1][1][1]]) is ValueError  # should be a TypeError
