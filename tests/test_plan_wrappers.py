"""Wrapped models and the what-if, on real Transformers classes from tiny configs (no downloads).

* A wrapper (a plain ``nn.Module`` holding the model, a value-head model, PEFT's forwarding
  ``PeftModel``) keeps exactly what the wrapped model keeps, under the wrapper's prefix: the
  wrapped model's plan is itself checked against ``from_pretrained`` in tests/test_plan_oracle.py.
  The real ``peft`` (in the ``test`` extra): ``get_peft_model`` with LoRA keeps the base tensors
  under ``base_model.model``, and its adapters follow the entries as Transformers' rules match
  them under the declaring model: adapters of the attention projections are not kept (cast to
  the low-precision dtype, trained), adapters of a kept module (LoRA on T5's ``wo``) are; cast
  below FP32 beside their FP32 base weight, they (not the base weight) are the refusal's
  culprits, with PEFT's fix. A forwarding stand-in (``PeftModelLike``) checks the same without
  PEFT's own code. The sharded runs are in tests/multirank/test_wrapped_models_fsdp2.py.
* ``transformers_version=`` answers from the class-level declarations, replaying that release's
  ``post_init``; the replay is checked against the installed ``post_init`` for every zoo model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from packaging.version import Version
from torch import nn

from fp32keep import KeepLayoutError, KeepPlan, keep_aware_cast, resolve_keep_plan
from fp32keep.layout.planning import plan_layout
from fp32keep.plan.compat import REGULAR_ATTR, STRICT_ATTR, installed_semantics, semantics_for
from fp32keep.plan.keep_plan import _post_init_lists
from pytest_fp32keep.check.zoo import ZOO, transformers_version
from tests.error_bounds import LIBRARY_BOUND_S, within
from tests.zoo_entries import available_or_skip

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
T5_WO = 4  # two encoder and two decoder blocks, one `wo` each


def t5() -> nn.Module:
    return ZOO["t5"].build()


class PlainWrapper(nn.Module):
    def __init__(self, model: nn.Module, attribute: str = "model") -> None:
        super().__init__()
        self.add_module(attribute, model)


class ValueHeadModel(nn.Module):
    """trl's shape: the language model under ``pretrained_model`` and a value head beside it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.pretrained_model = model
        self.v_head = nn.Linear(32, 1)


class _Forwarding(nn.Module):
    # PEFT forwards unknown attributes to the wrapped model (PeftModel -> LoraModel -> model).
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_model", "model"):
                raise
            inner = "base_model" if "base_model" in self._modules else "model"
            return getattr(self._modules[inner], name)


class LoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base_layer.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class LoraModelLike(_Forwarding):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        for name, module in list(model.named_modules()):
            if name.endswith(".wo"):
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, LoraLinear(module))


class PeftModelLike(_Forwarding):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = LoraModelLike(model)


def t5_keeps(dtype: torch.dtype) -> bool:
    """Whether the installed release keeps T5's ``wo`` under ``dtype``, from the zoo's written
    table (fp16 in every release; bf16 in 5.0.0 alone, whose regular list has no dtype gate:
    docs/transformers-keep-semantics.md), not from the resolver under test."""
    return ZOO["t5"].expectation(dtype) is not None


def prefixed(prefix: str, names: frozenset[str]) -> set[str]:
    return {f"{prefix}.{name}" for name in names}


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("wrap", "prefix"),
    [
        pytest.param(PlainWrapper, "model", id="plain"),
        pytest.param(ValueHeadModel, "pretrained_model", id="value-head"),
        pytest.param(lambda m: PlainWrapper(m, "two"), "two", id="prefix-with-entry-text"),
    ],
)
def test_wrapper_keeps_what_the_wrapped_model_keeps(
    wrap: Any, prefix: str, dtype: torch.dtype
) -> None:
    inner = t5()
    expected = prefixed(prefix, resolve_keep_plan(inner, dtype).param_names)
    assert len(expected) == (T5_WO if t5_keeps(dtype) else 0)
    plan = resolve_keep_plan(wrap(inner), dtype)
    assert set(plan.param_names) == expected
    assert plan.declared_by == (prefix,)
    if expected:
        assert f"declarations read from: [{prefix!r}]" in plan.describe()


def test_negative_control_full_names_would_match_the_wrappers_prefix() -> None:
    # Why entries are matched below the declaring model: in 5.x "wo" is a substring search, and
    # the wrapper attribute "two" would make every tensor under it kept.
    if installed_semantics().group == "A":
        pytest.skip("4.x matches whole segments; 'two' never matches 'wo'")
    pattern = installed_semantics().compile(["wo"], owner="T5")
    assert pattern.search("two.shared.weight") is not None


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_peft_style_wrapper_keeps_the_lora_wrapped_wo(dtype: torch.dtype) -> None:
    model = PeftModelLike(t5())
    assert hasattr(model, REGULAR_ATTR)  # forwarded, as PEFT forwards it
    plan = resolve_keep_plan(model, dtype)
    assert plan.declared_by == ("base_model.model",)
    kept = set(plan.param_names)
    if not t5_keeps(dtype):
        assert kept == set()
        return
    base = {name for name in kept if name.endswith(".wo.base_layer.weight")}
    adapters = {name for name in kept if ".wo.lora_" in name}
    assert len(base) == T5_WO and len(adapters) == 2 * T5_WO and kept == base | adapters
    assert all(name.startswith("base_model.model.") for name in kept)


# --- the real PEFT ------------------------------------------------------------------------

#: Zoo model, LoRA targets (its attention projections), and the dtype that keeps something.
PEFT_CASES = {"t5": (["q", "v"], FP16), "ernie4_5_moe": (["q_proj", "v_proj"], BF16)}


def peft_model(name: str, targets: list[str]) -> tuple[nn.Module, nn.Module]:
    """``(PeftModel, the model it wraps)``: LoRA on ``targets`` of the zoo model ``name``."""
    from peft import LoraConfig, get_peft_model

    entry = available_or_skip(name)
    inner = entry.build()
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(inner, config), inner


def floating_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {name: t.dtype for name, t in tensors.items() if t.is_floating_point()}


@pytest.mark.parametrize("name", list(PEFT_CASES))
def test_real_peft_keeps_the_base_tensors_and_casts_the_adapters(name: str) -> None:
    targets, dtype = PEFT_CASES[name]
    model, inner = peft_model(name, targets)
    expected = resolve_keep_plan(inner, dtype)
    prefix = "base_model.model"
    plan = resolve_keep_plan(model, dtype)
    assert plan.declared_by == (prefix,)
    assert set(plan.param_names) == prefixed(prefix, expected.param_names) != set()
    assert set(plan.buffer_names) == prefixed(prefix, expected.buffer_names)
    keep_aware_cast(model, dtype, plan=plan)
    dtypes = floating_dtypes(model)
    adapters = {n for n in dtypes if ".lora_" in n}
    assert adapters and not adapters & plan.names  # the projections' adapters are not kept
    for tensor, got in dtypes.items():  # kept: FP32; the rest, adapters too: the dtype
        assert got == (torch.float32 if tensor in plan.names else dtype), tensor
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in adapters if n in dict(model.named_parameters())}


def test_real_peft_adapters_of_a_kept_module_are_kept_and_form_its_unit() -> None:
    # LoRA on T5's `wo`: the adapters' names under T5 (`...wo.lora_A.default.weight`) match the
    # entry in every release line (a whole segment in 4.x, a substring in 5.x).
    model, _ = peft_model("t5", ["wo"])
    plan = resolve_keep_plan(model, FP16)
    kept = set(plan.param_names)
    base = {n for n in kept if n.endswith(".wo.base_layer.weight")}
    adapters = {n for n in kept if ".wo.lora_" in n}
    assert len(base) == T5_WO and len(adapters) == 2 * T5_WO and kept == base | adapters
    keep_aware_cast(model, FP16, plan=plan)
    assert {floating_dtypes(model)[n] for n in kept} == {torch.float32}
    # The PEFT layer holding base weight and adapters is fully kept: one kept unit each.
    units = [unit for unit in plan_layout(model, plan).units if unit.kind == "kept"]
    assert sorted(fqn for unit in units for fqn in unit.module_fqns) == sorted(
        name.removesuffix(".base_layer.weight") for name in base
    )


def test_negative_control_peft_classes_declare_nothing() -> None:
    # A resolver that reads the top module's class (PeftModel) finds no declaration, and a cast
    # with its empty plan degrades every `wo`; the forwarded attribute hides that.
    model, _ = peft_model("t5", ["q", "v"])
    assert hasattr(model, REGULAR_ATTR)  # forwarded to the T5 model by PEFT's __getattr__
    assert all(REGULAR_ATTR not in vars(cls) for cls in type(model).__mro__)
    empty = dataclasses.replace(
        resolve_keep_plan(model, FP16),
        param_names=frozenset(),
        buffer_names=frozenset(),
        matches={},
    )
    keep_aware_cast(model, FP16, plan=empty)
    wo = {n: d for n, d in floating_dtypes(model).items() if n.endswith(".wo.weight")}
    assert len(wo) == T5_WO and set(wo.values()) == {FP16}


def t5_wo_lora_with_adapters_in(
    dtype: torch.dtype, *, only: str = "", base_trainable: bool = False
) -> tuple[nn.Module, KeepPlan]:
    """LoRA on T5's kept ``wo`` (fp16 plan), cast keep-aware (base and adapters FP32), then the
    adapters whose name ends with ``only`` (all by default) cast to ``dtype``, as a trainer that
    casts the trainable parameters to the compute dtype does."""
    model, _ = peft_model("t5", ["wo"])
    plan = resolve_keep_plan(model, FP16)
    keep_aware_cast(model, FP16, plan=plan)
    for name, module in model.named_modules():
        if name.endswith((".lora_A", ".lora_B")) and name.endswith(only):
            module.to(dtype)
        if base_trainable and name.endswith(".wo.base_layer"):
            module.requires_grad_(True)
    return model, plan


def lora_names(model: nn.Module, part: str = ".lora_") -> set[str]:
    return {name for name, _ in model.named_parameters() if part in name}


@pytest.mark.parametrize("base_trainable", [False, True], ids=["base-frozen", "base-trainable"])
def test_real_peft_low_precision_adapters_of_a_kept_module_are_named_not_their_fp32_base(
    base_trainable: bool,
) -> None:
    # The base weight is right (kept, FP32): only the adapters are the mixed-dtype culprits,
    # with the adapters' own fix, not FP32 master weights for everything.
    model, plan = t5_wo_lora_with_adapters_in(FP16, base_trainable=base_trainable)
    with within(LIBRARY_BOUND_S), pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan)
    adapters = lora_names(model)
    assert len(adapters) == 2 * T5_WO
    assert {(p.fqn, p.reason) for p in error.value.problems} == {
        (name, "mixed-dtype-unit") for name in adapters
    }
    text = str(error.value)
    first = "base_model.model.encoder.block.0.layer.1.DenseReluDense.wo"
    assert (
        f"{first}.lora_A.default.weight  [mixed-dtype-unit] is an adapter stored as "
        f"torch.float16 beside its torch.float32 base weight '{first}.base_layer.weight'"
    ) in text
    assert "autocast_adapter_dtype=True" in text and "cast the adapters to torch.float32" in text
    assert "upcast_to_fp32_master" not in text  # the advice to upcast everything
    crash = "FSDP expects uniform original parameter dtype"
    assert (crash in text) is base_trainable  # FSDP2 fails only on trainable dtypes that differ


def test_real_peft_only_the_adapters_below_fp32_are_named() -> None:
    model, plan = t5_wo_lora_with_adapters_in(BF16, only=".lora_B")
    with within(LIBRARY_BOUND_S), pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan)
    assert set(error.value.fqns) == lora_names(model, ".lora_B.")
    assert {problem.reason for problem in error.value.problems} == {"mixed-dtype-unit"}
    assert "torch.bfloat16" in str(error.value)


def test_negative_control_real_peft_fp32_adapters_of_a_kept_module_are_accepted() -> None:
    # PEFT's default: adapters in the base layer's dtype, FP32 here. Accepted, base trainable
    # too (every trainable parameter of the unit is FP32).
    model, plan = t5_wo_lora_with_adapters_in(FP32, base_trainable=True)
    assert {p.dtype for n, p in model.named_parameters() if ".wo." in n} == {FP32}
    kept = [unit for unit in plan_layout(model, plan).units if unit.kind == "kept"]
    assert len(kept) == T5_WO


def test_the_refusals_fix_for_adapters_is_one_that_works() -> None:
    # The fix the refusal names: PEFT's own cast of the adapters back to FP32.
    from peft.tuners.tuners_utils import cast_adapter_dtype

    model, plan = t5_wo_lora_with_adapters_in(FP16)
    with pytest.raises(KeepLayoutError):
        plan_layout(model, plan)
    cast_adapter_dtype(model, "default", autocast_adapter_dtype=True)
    kept = [unit for unit in plan_layout(model, plan).units if unit.kind == "kept"]
    assert len(kept) == T5_WO


# --- the what-if ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "fp16", "bf16"),
    [
        ("4.56.2", T5_WO, 0),
        ("5.0.0", T5_WO, T5_WO),  # no dtype gate in 5.0.0
        ("5.10.4", T5_WO, 0),
        ("5.24.0", T5_WO, 0),
        ("5.25.0", T5_WO, 0),  # T5's regular ["wo"] and the fp16-only gate, as in 5.24
    ],
)
def test_what_if_on_t5_matches_each_release(version: str, fp16: int, bf16: int) -> None:
    # The counts are what each release's from_pretrained keeps (semantics document).
    model = t5()
    for dtype, count in ((FP16, fp16), (BF16, bf16)):
        plan = resolve_keep_plan(model, dtype, transformers_version=version)
        assert len(plan.param_names) == count, (version, dtype)
        assert all(name.endswith("DenseReluDense.wo.weight") for name in plan.param_names)


def test_negative_control_runtime_sets_are_what_5_0_0_would_ignore() -> None:
    # Reading the installed post_init's runtime attribute (a set in 5.1+) under 5.0.0's rules
    # keeps nothing: the bug the class-level reading fixes.
    if Version(transformers_version()) < Version("5.1"):
        pytest.skip("4.x and 5.0.0 leave the declarations as lists")
    model = t5()
    assert isinstance(getattr(model, REGULAR_ATTR), set)
    assert semantics_for("5.0.0").declared(getattr(model, REGULAR_ATTR)) is None


@pytest.mark.parametrize("name", list(ZOO))
def test_post_init_replay_matches_the_installed_post_init(name: str) -> None:
    """The 5.1+ replay used for the what-if equals what the installed 5.1+ post_init built."""
    if installed_semantics().group != "C":
        pytest.skip("the installed release does not run 5.1+'s post_init")
    entry = available_or_skip(name)
    model = entry.build()
    for attribute in (REGULAR_ATTR, STRICT_ATTR):
        runtime = set(getattr(model, attribute) or ())
        assert set(_post_init_lists(model, attribute)) == runtime, (name, attribute)
