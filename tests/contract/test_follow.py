"""What the reference follows of the implementation (``contract/follow.py``), pure: which
tensors count as FP32 storage under master weights, which parameters train, and the values the
reference and the control are given."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fp32keep
from pytest_fp32keep.contract.follow import (
    Choices,
    cast_following,
    follow,
    read_choices,
    stored_fp32,
    values_of,
)
from tests.core.toys import stack_class

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _built() -> tuple[nn.Module, nn.Module, fp32keep.KeepPlan]:
    """A kept-``wo`` toy with a not-kept and a kept buffer; its keep-aware bf16 reference."""
    torch.manual_seed(0)
    model = stack_class(strict=["wo"])()
    model.layers[0].register_buffer("table", torch.randn(4) / 3)  # not kept
    model.layers[1].wo.register_buffer("scale", torch.randn(4) / 3)  # kept (its module's)
    model.layers[1].requires_grad_(False)  # frozen by the factory
    plan = fp32keep.resolve_keep_plan(model, BF16)
    reference = copy.deepcopy(model)
    fp32keep.keep_aware_cast(reference, BF16, plan=plan)
    return model, reference, plan


def test_fp32_candidates_are_the_not_kept_tensors_the_model_holds_in_fp32() -> None:
    model, reference, plan = _built()
    assert "layers.1.wo.scale" in plan
    model.to(FP32)  # the whole-module upcast: everything FP32
    model.layers[0].attn.bias.data = model.layers[0].attn.bias.data.to(FP16)  # neither dtype
    found = stored_fp32(model, reference, plan, BF16)
    assert {"layers.0.table", "layers.1.attn.weight", "embed.weight"} <= found
    assert not any(name in plan for name in found)  # kept tensors are never a choice
    assert "layers.0.attn.bias" not in found  # fp16 is not FP32
    fp32keep.keep_aware_cast(model, BF16, plan=plan)  # the low convention: nothing to follow
    assert stored_fp32(model, reference, plan, BF16) == frozenset()


def test_only_buffers_and_frozen_parameters_follow_and_only_under_master_weights() -> None:
    model, reference, plan = _built()
    model.to(FP32)
    candidates = stored_fp32(model, reference, plan, BF16)
    masters = read_choices(model, reference, candidates, master=True)
    assert "layers.0.table" in masters.fp32  # a buffer
    assert "layers.1.attn.weight" in masters.fp32  # frozen by the factory
    assert "layers.0.attn.weight" not in masters.fp32  # trainable: a master weight, not a choice
    assert read_choices(model, reference, candidates, master=False).fp32 == frozenset()


def test_follow_sets_requires_grad_modes_and_values_and_says_so() -> None:
    model, reference, _ = _built()
    model.layers[0].requires_grad_(False)  # the implementation freezes more
    model.layers[1].requires_grad_(True)  # and thaws what the factory froze
    model.eval()
    choices = Choices(
        {n: p.requires_grad for n, p in model.named_parameters()},
        {f: m.training for f, m in model.named_modules()},
        frozenset({"layers.0.table"}),
    )
    notes = choices.notes(reference)
    assert any("frozen that the model factory builds trainable" in n for n in notes)
    assert any("layers.0.attn.weight" in n for n in notes)
    assert any("trainable that the model factory builds frozen" in n for n in notes)
    assert any("train/eval mode" in n for n in notes)
    assert any("FP32 master weights" in n and "layers.0.table" in n for n in notes)
    values = values_of(model, choices.fp32)
    follow(reference, choices, values)
    assert not reference.layers[0].attn.weight.requires_grad
    assert reference.layers[1].attn.weight.requires_grad
    assert not any(m.training for m in reference.modules())
    table = reference.layers[0].table
    assert table.dtype == FP32 and torch.equal(table, model.layers[0].table)  # not rounded


def test_cast_following_keeps_the_built_values_of_the_fp32_tensors() -> None:
    model, _, plan = _built()
    built = model.layers[0].table.clone()
    choices = Choices({}, {}, frozenset({"layers.0.table"}))
    cast_following(model, choices, lambda m: fp32keep.keep_aware_cast(m, BF16, plan=plan))
    assert model.layers[0].table.dtype == FP32 and torch.equal(model.layers[0].table, built)
    assert model.layers[0].attn.weight.dtype == BF16  # everything else cast as usual
    # the negative control: without the choice the buffer is rounded through bf16
    other, _, _ = _built()
    cast_following(other, Choices({}, {}, frozenset()), lambda m: m.to(BF16))
    assert not torch.equal(other.layers[0].table.float(), built)
