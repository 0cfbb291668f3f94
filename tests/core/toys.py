"""Tiny plain ``nn.Module`` models for single-process tests of the plan, the cast and the layout."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
from torch import nn

import fp32keep
from fp32keep import KeepPlan

SEMANTICS = "5.10.4"
"""The Transformers rules the layout tests resolve with (5.x globs), whatever is installed."""


def cast_bf16(model: nn.Module) -> KeepPlan:
    """``model`` cast to bf16 the keep-aware way under :data:`SEMANTICS`; the plan it followed."""
    plan = fp32keep.resolve_keep_plan(model, torch.bfloat16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, torch.bfloat16, plan=plan)
    return plan


class Holder(nn.Module):
    """A callable leaf-or-branch module: its forward is never run by the layout tests."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not executed
        return x


def model_with_names(
    names: Iterable[str],
    *,
    regular: object = None,
    strict: object = None,
    buffers: Sequence[str] = (),
    int_buffers: Sequence[str] = (),
    class_name: str = "Toy",
) -> nn.Module:
    """A model whose parameters (and buffers) have exactly the given fully qualified names."""
    attributes: dict[str, object] = {"forward": Holder.forward}
    if regular is not None:
        attributes["_keep_in_fp32_modules"] = regular
    if strict is not None:
        attributes["_keep_in_fp32_modules_strict"] = strict
    root: nn.Module = type(class_name, (nn.Module,), attributes)()

    def owner(path: str) -> tuple[nn.Module, str]:
        *parents, leaf = path.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, Holder())
            module = getattr(module, part)
        return module, leaf

    for name in names:
        module, leaf = owner(name)
        module.register_parameter(leaf, nn.Parameter(torch.randn(4, 2)))
    for name in buffers:
        module, leaf = owner(name)
        module.register_buffer(leaf, torch.randn(4))
    for name in int_buffers:
        module, leaf = owner(name)
        module.register_buffer(leaf, torch.arange(4))
    return root


class RMSNorm(nn.Module):
    """Hugging Face style: normalise in FP32, scale in the weight dtype, keep the input dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.weight * h.to(self.weight.dtype)).to(dtype)


class Block(nn.Module):
    """A transformer-ish block: attention projection, MLP with a kept ``wo``, two norms.

    Like T5's ``DenseReluDense`` the ``wo`` projection computes in its weight's dtype and hands
    back the activation dtype it received, so a kept ``wo`` works with a low-precision stream.
    """

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.input_layernorm = RMSNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.wo = nn.Linear(width, width, bias=False)
        self.post_attention_layernorm = RMSNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        h = self.mlp(self.post_attention_layernorm(x))
        return x + self.wo(h.to(self.wo.weight.dtype)).to(h.dtype)


class Stack(nn.Module):
    """Embedding, a ModuleList of blocks, a final norm and a head: the usual decoder shape."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, width: int = 8, depth: int = 2, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def stack_class(
    *, regular: list[str] | None = None, strict: list[str] | None = None
) -> type[Stack]:
    """A ``Stack`` subclass declaring the given keep lists."""
    attributes: dict[str, object] = {}
    if regular is not None:
        attributes["_keep_in_fp32_modules"] = regular
    if strict is not None:
        attributes["_keep_in_fp32_modules_strict"] = strict
    return type("KeptStack", (Stack,), attributes)
