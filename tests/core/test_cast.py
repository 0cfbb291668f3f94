"""keep_aware_cast and upcast_to_fp32_master, single process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp32keep import keep_aware_cast, resolve_keep_plan, upcast_to_fp32_master
from tests.core.toys import model_with_names, stack_class

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    return {name: tensor.dtype for name, tensor in named}


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_kept_tensors_stay_fp32_others_take_the_dtype(dtype: torch.dtype) -> None:
    model = model_with_names(
        ["a.wo.weight", "a.x.weight"],
        strict=["wo"],
        buffers=["a.wo.scale", "a.x.scale"],
        int_buffers=["a.wo.index"],
    )
    assert keep_aware_cast(model, dtype) is model
    assert dtypes(model) == {
        "a.wo.weight": FP32,
        "a.x.weight": dtype,
        "a.wo.scale": FP32,
        "a.x.scale": dtype,
        "a.wo.index": torch.int64,
    }


def test_values_are_what_model_to_gives() -> None:
    torch.manual_seed(0)
    model = model_with_names(["a.wo.weight", "a.x.weight"], strict=["wo"])
    expected_x = model.a.x.weight.detach().to(BF16)
    expected_wo = model.a.wo.weight.detach().clone()
    keep_aware_cast(model, BF16)
    assert torch.equal(model.a.x.weight, expected_x)
    assert torch.equal(model.a.wo.weight, expected_wo)


def test_degraded_kept_tensor_becomes_fp32_again() -> None:
    model = model_with_names(["a.wo.weight", "a.x.weight"], strict=["wo"])
    model.to(BF16)  # the blanket cast that breaks the contract
    keep_aware_cast(model, BF16)
    assert model.a.wo.weight.dtype == FP32


def test_parameter_identity_and_grads_survive() -> None:
    model = model_with_names(["a.wo.weight", "a.x.weight"], strict=["wo"])
    params_before = dict(model.named_parameters())
    model.a.x.weight.grad = torch.ones_like(model.a.x.weight)
    keep_aware_cast(model, BF16)
    assert all(params_before[name] is param for name, param in model.named_parameters())
    grad = model.a.x.weight.grad
    assert grad is not None and grad.dtype == BF16


def test_tied_parameters_stay_tied_and_kept() -> None:
    model = model_with_names(["enc.wo.weight", "dec.proj.weight"], strict=["wo"])
    model.dec.proj.weight = model.enc.wo.weight
    keep_aware_cast(model, BF16)
    assert model.dec.proj.weight is model.enc.wo.weight
    assert model.enc.wo.weight.dtype == FP32


def test_tied_buffers_stay_tied() -> None:
    model = model_with_names(["a.wo.weight", "b.x.weight"], strict=["wo"], buffers=["a.wo.s"])
    model.b.register_buffer("s", model.a.wo.s)
    keep_aware_cast(model, BF16)
    assert model.b.s is model.a.wo.s
    assert model.b.s.dtype == FP32  # kept through its alias a.wo.s


def test_packed_float8_and_integers_are_untouched() -> None:
    model = model_with_names(["a.q.weight", "a.x.weight"])
    model.a.q.weight.data = model.a.q.weight.data.to(torch.float8_e4m3fn)
    keep_aware_cast(model, BF16)
    assert model.a.q.weight.dtype == torch.float8_e4m3fn
    assert model.a.x.weight.dtype == BF16


def test_explicit_plan_is_used_and_checked() -> None:
    model = model_with_names(["a.wo.weight", "a.x.weight"], strict=["wo"])
    plan = resolve_keep_plan(model, FP16)
    keep_aware_cast(model, FP16, plan=plan)
    assert model.a.wo.weight.dtype == FP32

    other = model_with_names(["b.y.weight"])
    before = dtypes(other)
    with pytest.raises(ValueError, match=r"a\.wo\.weight.*resolve the plan on this model"):
        keep_aware_cast(other, FP16, plan=plan)
    assert dtypes(other) == before  # nothing half-applied


@pytest.mark.parametrize("bad", [torch.int32, "bf16"])
def test_bad_dtype_changes_nothing(bad: object) -> None:
    model = model_with_names(["a.wo.weight"], strict=["wo"])
    with pytest.raises((TypeError, ValueError), match="dtype"):
        keep_aware_cast(model, bad)  # type: ignore[arg-type]
    assert model.a.wo.weight.dtype == FP32


def test_stack_with_kept_norms() -> None:
    model = stack_class(strict=["norm"])()
    keep_aware_cast(model, BF16, plan=resolve_keep_plan(model, BF16, transformers_version="5.10.4"))
    for name, dtype in dtypes(model).items():
        assert dtype == (FP32 if "norm" in name else BF16), name


# --- upcast_to_fp32_master ---------------------------------------------------------------


def test_upcast_assigns_data_of_trainable_low_precision_params() -> None:
    model = model_with_names(["a.x.weight", "a.frozen.weight", "a.norm.weight"])
    model.to(BF16)
    model.a.norm.weight.data = model.a.norm.weight.data.float()
    model.a.frozen.weight.requires_grad_(False)
    identity = model.a.x.weight
    values = model.a.x.weight.detach().clone()
    assert upcast_to_fp32_master(model) is model
    assert model.a.x.weight is identity
    assert model.a.x.weight.dtype == FP32
    assert torch.equal(model.a.x.weight, values.float())
    assert model.a.frozen.weight.dtype == BF16  # frozen weights are not optimizer state
    assert model.a.norm.weight.dtype == FP32


def test_upcast_skips_quantized_parameters() -> None:
    class Params4bit(nn.Parameter):
        """Stands in for bitsandbytes' class of the same name (matched by name)."""

    model = model_with_names(["a.x.weight"])
    packed = nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
    model.a.register_parameter("packed", packed)
    model.a.register_parameter("fp8", nn.Parameter(torch.zeros(4).to(torch.float8_e4m3fn)))
    model.a.register_parameter("nf4", Params4bit(torch.zeros(4, dtype=BF16)))
    upcast_to_fp32_master(model)
    assert model.a.packed.dtype == torch.uint8
    assert model.a.fp8.dtype == torch.float8_e4m3fn
    assert model.a.nf4.dtype == BF16


def test_upcast_composes_with_keep_plan() -> None:
    model = stack_class(strict=["norm"])()
    keep_aware_cast(model, BF16, plan=resolve_keep_plan(model, BF16, transformers_version="5.10.4"))
    upcast_to_fp32_master(model)
    assert set(dtypes(model).values()) == {FP32}
