"""The master-weight storage convention, in one process: validation, expected dtypes, the CLI.

The multi-rank half (fp32keep passing, the two framework bugs failing) is
tests/multirank/test_master_dtype_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp32keep
from pytest_fp32keep import assert_fp32_keep_contract, build_unsharded_reference
from pytest_fp32keep.check.arguments import build_parser
from pytest_fp32keep.check.ranks import MASTER_DTYPES
from pytest_fp32keep.contract.master import expected_storage
from pytest_fp32keep.contract.policy import expected_grads
from tests.core.toys import stack_class
from tests.error_bounds import LIBRARY_BOUND_S, PARENT_BOUND_S, within

BF16, FP32 = torch.bfloat16, torch.float32


def toy() -> nn.Module:
    model = stack_class(strict=["wo"])()
    model.register_buffer("scale", torch.ones(3))
    model.layers[1].attn.weight.requires_grad_(False)  # frozen: not a master weight
    return model


@pytest.mark.parametrize(
    "master", [torch.bfloat16, torch.float64, "fp32"], ids=["bf16", "fp64", "string"]
)
def test_unsupported_master_dtype_is_refused_before_anything_is_built(master: object) -> None:
    built: list[nn.Module] = []

    def factory() -> nn.Module:
        built.append(toy())
        return built[-1]

    with within(LIBRARY_BOUND_S), pytest.raises(ValueError, match="master_dtype=") as error:
        assert_fp32_keep_contract(
            factory,
            lambda model: None,
            mesh=None,  # type: ignore[arg-type]
            dtype=BF16,
            master_dtype=master,  # type: ignore[arg-type]
        )
    assert "None" in str(error.value)
    assert "torch.float32" in str(error.value)
    assert built == []


def test_reference_with_master_weights_needs_a_known_master_and_a_dtype() -> None:
    with within(LIBRARY_BOUND_S), pytest.raises(ValueError, match=r"master_dtype=torch\.bfloat16"):
        build_unsharded_reference(toy, BF16, master_dtype=torch.bfloat16)
    with within(LIBRARY_BOUND_S), pytest.raises(ValueError, match="needs the low-precision"):
        build_unsharded_reference(toy, master_dtype=FP32)


def test_reference_with_master_weights_stores_fp32_masters_of_the_cast_values() -> None:
    compute = build_unsharded_reference(toy, BF16)
    master = build_unsharded_reference(toy, BF16, master_dtype=FP32)
    for (name, low), (_, high) in zip(
        compute.named_parameters(), master.named_parameters(), strict=True
    ):
        assert high.dtype == (FP32 if low.requires_grad else low.dtype), name
        assert torch.equal(high.to(low.dtype), low), name  # the same values, upcast exactly


def test_expected_storage_follows_the_convention() -> None:
    model = toy()
    plan = fp32keep.resolve_keep_plan(model, BF16)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    low = expected_storage(model, plan, None)
    master = expected_storage(model, plan, FP32)
    assert low["layers.0.wo.weight"] == master["layers.0.wo.weight"] == FP32  # kept: either way
    assert low["embed.weight"] == BF16
    assert master["embed.weight"] == FP32
    assert low["layers.1.attn.weight"] == master["layers.1.attn.weight"] == BF16  # frozen
    assert low["scale"] == master["scale"] == BF16  # buffers are not master weights


def test_expected_gradients_are_the_reference_gradients_in_each_storage_dtype() -> None:
    model = toy()
    plan = fp32keep.resolve_keep_plan(model, BF16)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    grads = {
        "embed.weight": torch.tensor([1.5, -2.0], dtype=BF16),
        "layers.0.wo.weight": torch.tensor([0.1]),
        "layers.1.attn.weight": None,
    }
    assert expected_grads(grads, expected_storage(model, plan, None)) == grads
    master = expected_grads(grads, expected_storage(model, plan, FP32))
    assert master["embed.weight"] is not None
    assert master["embed.weight"].dtype == FP32
    assert master["layers.0.wo.weight"] is grads["layers.0.wo.weight"]
    assert master["layers.1.attn.weight"] is None
    # bf16 compute over fp16 storage: the gradient lands rounded to fp16, as FSDP2 stores it
    fp16 = expected_grads(grads, {"embed.weight": torch.float16})
    assert fp16["embed.weight"] is not None
    assert fp16["embed.weight"].dtype == torch.float16


def test_cli_measure_spread_option() -> None:
    assert build_parser().parse_args(["check", "ernie4_5_moe", "--measure-spread"]).measure_spread
    assert not build_parser().parse_args(["check"]).measure_spread


def test_cli_master_dtype_option() -> None:
    args = build_parser().parse_args(["check", "t5", "--master-dtype", "fp32"])
    assert MASTER_DTYPES[args.master_dtype] is FP32
    assert MASTER_DTYPES[build_parser().parse_args(["check"]).master_dtype] is None


def test_cli_unknown_master_dtype_is_a_usage_error_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with within(PARENT_BOUND_S), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["check", "--master-dtype", "bf16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--master-dtype" in err
    assert "'fp32'" in err
    assert "fp32keep check: error: argument --master-dtype: invalid choice" in err
