"""Tests of ``build_unsharded_reference`` (the sharded-module case runs in test_probe_fsdp.py)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from pytest_fp32keep.contract.reference import build_unsharded_reference, seeded

FP16, FP32 = torch.float16, torch.float32


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids) * self.scale))


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_bit_identical(a: nn.Module, b: nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        # Compare bits, not values: -0.0 == 0.0 and NaN != NaN would hide differences.
        assert torch.equal(sa[key].view(torch.uint8), sb[key].view(torch.uint8)), key


def test_module_is_deep_copied_and_independent() -> None:
    model = Tied()
    reference = build_unsharded_reference(model)
    assert reference is not model
    assert_bit_identical(reference, model)
    assert reference.head.weight is reference.embed.weight  # ties survive within the copy
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(reference(ids), model(ids))
    with torch.no_grad():
        model.embed.weight.add_(1.0)
        model.scale.mul_(0)
    assert not torch.equal(reference.embed.weight, model.embed.weight)
    assert not torch.equal(reference.scale, model.scale)
    assert all(
        p.data_ptr() != q.data_ptr()
        for p, q in zip(reference.parameters(), model.parameters(), strict=True)
    )


def test_factory_is_seeded_and_reproducible() -> None:
    first = build_unsharded_reference(Tied, seed=3)
    second = build_unsharded_reference(Tied, seed=3)
    assert_bit_identical(first, second)
    with seeded(3):
        again = Tied()
    assert_bit_identical(first, again)
    other = build_unsharded_reference(Tied, seed=4)
    assert not torch.equal(first.embed.weight, other.embed.weight)


def test_factory_seeds_python_random_too() -> None:
    class UsesRandom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("value", torch.tensor(random.random()))

    a = build_unsharded_reference(UsesRandom, seed=5)
    b = build_unsharded_reference(UsesRandom, seed=5)
    assert torch.equal(a.value, b.value)


def test_building_does_not_disturb_the_callers_random_streams() -> None:
    torch.manual_seed(123)
    random.seed(123)
    expected_torch, expected_python = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(123)
    build_unsharded_reference(Tied, seed=0)
    assert torch.equal(torch.rand(3), expected_torch)
    assert random.random() == expected_python


def test_device_move_keeps_dtypes() -> None:
    model = Tied().to(FP16)
    reference = build_unsharded_reference(model, device="meta")
    assert reference.embed.weight.device.type == "meta"
    assert reference.embed.weight.dtype == FP16
    assert model.embed.weight.device.type == "cpu"


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module or a zero-argument factory"):
        build_unsharded_reference(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"returned str, not an nn\.Module"):
        build_unsharded_reference(lambda: "model")  # type: ignore[arg-type, return-value]


def _tiny_t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=32,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
    )
    return transformers.T5ForConditionalGeneration(config)  # type: ignore[no-any-return]


def test_dtype_casts_keep_aware_and_matches_a_second_build() -> None:
    # T5 declares _keep_in_fp32_modules = ["wo"], which applies under fp16.
    reference = build_unsharded_reference(_tiny_t5, FP16, seed=7)
    again = build_unsharded_reference(_tiny_t5, FP16, seed=7)
    assert_bit_identical(reference, again)
    with seeded(7):
        original = _tiny_t5()
    dtypes = {name: p.dtype for name, p in reference.named_parameters()}
    kept = {name for name in dtypes if name.endswith("DenseReluDense.wo.weight")}
    assert kept, dtypes
    assert {dtypes[name] for name in kept} == {FP32}
    assert {d for name, d in dtypes.items() if name not in kept} == {FP16}
    originals = dict(original.named_parameters())
    for name, param in reference.named_parameters():
        # Kept tensors are the original FP32 bits, the rest exactly original.to(fp16).
        expected = originals[name].detach().to(param.dtype)
        assert torch.equal(param.detach().view(torch.uint8), expected.view(torch.uint8)), name


def test_dtype_with_a_module_casts_the_copy_only() -> None:
    model = _tiny_t5()
    reference = build_unsharded_reference(model, FP16)
    assert {p.dtype for p in model.parameters()} == {FP32}
    assert {p.dtype for p in reference.parameters()} == {FP16, FP32}
