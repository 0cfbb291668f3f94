"""A kept module handed to a module-level function that reads its tensors: observed, not guessed.

Transformers 5.25's Bailing-Hybrid no longer spells ``self.conv1d.weight`` in its attention:
it hands the module to ``causal_conv1d_forward(self.conv1d, ...)``, which reads
``conv1d.weight`` and never calls ``conv1d``. Taken as called, ``conv1d`` would be a unit of its
own that FSDP2 never gathers, and the first forward fails with ``aten.convolution.default: got
mixed torch.Tensor and DTensor`` (seen with 5.25 on 2 gloo ranks). An observed forward
(``apply_fsdp2(example_inputs=...)``) sees the read wherever the function lives (a plain
function, ``kernels``' module around it, ``*args``); the source fallback does not follow
functions, and names the hand-off for its warning instead. Each negative control is one way the
same hand-off is not a read: the function calls the module, or reads only metadata.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fp32keep import keep_aware_cast, observe_parameter_use, plan_layout, resolve_keep_plan
from fp32keep.uses.source import find_direct_read, unseen_uses
from tests.core.toys import RMSNorm

BF16 = torch.bfloat16
SEMANTICS = "5.10.4"  # 5.x glob entries, whatever the installed release


def depthwise_forward(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Reads ``conv.weight`` (as ``causal_conv1d_forward`` does), never calls ``conv``."""
    weight = conv.weight
    x = x.transpose(1, 2).to(weight.dtype)
    x = nn.functional.conv1d(
        nn.functional.pad(x, (weight.shape[-1] - 1, 0)), weight, None, 1, 0, 1, x.shape[1]
    )
    return x.transpose(1, 2)


def calling_forward(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Calls ``conv``: FSDP2's hooks gather it, as for any unit."""
    x = x.transpose(1, 2).to(conv.weight.dtype)
    return conv(nn.functional.pad(x, (conv.kernel_size[0] - 1, 0))).transpose(1, 2)


def metadata_forward(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Reads ``conv.weight.dtype`` only, which a sharded DTensor answers."""
    return x.to(conv.weight.dtype)


def init_conv(conv: nn.Conv1d) -> None:
    """Reads ``conv.weight`` at construction only (as ``tie(head, embedding)`` does)."""
    with torch.no_grad():
        conv.weight.mul_(0.5)


def star_forward(*modules_and_input: Any) -> torch.Tensor:
    """Receives the module in ``*args``: no parameter name to follow."""
    conv, x = modules_and_input
    return depthwise_forward(conv, x)


def as_function_module(function: Any) -> nn.Module:
    """``function`` as ``kernels``' ``use_kernel_forward_from_hub`` leaves it: an ``nn.Module``
    instance whose ``forward(self, *args, **kwargs)`` returns ``function(*args, **kwargs)``."""

    class Func(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    return Func()


def as_reordering_module(function: Any) -> nn.Module:
    """A function module that does not hand its arguments on as given (it drops the first):
    which parameter the module arrives in is not known, so nothing is followed."""

    class Func(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args[1:], **kwargs)

    return Func()


kernel_depthwise_forward = as_function_module(depthwise_forward)
kernel_calling_forward = as_function_module(calling_forward)
reordering_depthwise_forward = as_reordering_module(depthwise_forward)


class _HandingAttention(nn.Module):
    helper: ClassVar[str] = "depthwise"

    def __init__(self, width: int = 8, kernel: int = 3) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=False)
        self.conv = nn.Conv1d(width, width, kernel, groups=width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)


class HandingAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(depthwise_forward(self.conv, self.q_proj(x)).to(x.dtype))


class KeywordAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(depthwise_forward(x=self.q_proj(x), conv=self.conv).to(x.dtype))


class KernelModuleAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(kernel_depthwise_forward(self.conv, self.q_proj(x)).to(x.dtype))


class KernelCallingAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(kernel_calling_forward(self.conv, self.q_proj(x)).to(x.dtype))


class ReorderingAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(reordering_depthwise_forward(x, self.conv, self.q_proj(x)).to(x.dtype))


class CallingAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(calling_forward(self.conv, self.q_proj(x)).to(x.dtype))


class MetadataAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(metadata_forward(self.conv, self.q_proj(x)).to(x.dtype))


class InitAttention(_HandingAttention):
    def __init__(self, width: int = 8, kernel: int = 3) -> None:
        super().__init__(width, kernel)
        init_conv(self.conv)  # construction: nothing FSDP2 gathers is read here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x))


class StarAttention(_HandingAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(star_forward(self.conv, self.q_proj(x)).to(x.dtype))


def stack(attention: type[nn.Module]) -> nn.Module:
    class Block(nn.Module):
        def __init__(self, width: int = 8) -> None:
            super().__init__()
            self.norm = RMSNorm(width)
            self.self_attn = attention(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.self_attn(self.norm(x))

    class Stack(nn.Module):
        _no_split_modules: ClassVar[list[str]] = ["Block"]
        _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["conv"]

        def __init__(self, width: int = 8, vocab: int = 16) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList(Block(width) for _ in range(2))
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Stack()


IDS = torch.arange(6).reshape(1, 6)
CONV = "layers.0.self_attn.conv"


def observed(model: nn.Module) -> Any:
    with observe_parameter_use(model) as use:
        model(IDS)
    return use


@pytest.mark.parametrize(
    "attention", [HandingAttention, KeywordAttention, KernelModuleAttention, StarAttention]
)
def test_a_module_handed_to_a_reading_function_is_observed_as_read(attention: type) -> None:
    model = stack(attention)
    read = observed(model).direct_read(model, CONV)
    assert read is not None
    assert (read.reader, read.reader_fqn, read.expression, read.evidence) == (
        attention.__name__,
        "layers.0.self_attn",
        "conv.weight",
        f"observed in {attention.__name__}.forward",
    )
    # The source fallback does not follow the function: no read, the hand-off named instead.
    assert find_direct_read(model, CONV) is None
    assert f"{attention.__name__}.forward(): self.conv handed to a function" in unseen_uses(model)


def test_the_observed_read_goes_with_its_reader_and_the_model_runs() -> None:
    model = stack(HandingAttention)
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(model, BF16, plan=plan)
    layout = plan_layout(model, plan, observed=observed(model))
    assert layout.owner[f"{CONV}.weight"] == "layers.0.self_attn"
    assert all(CONV not in unit.module_fqns for unit in layout.units)
    assert model(IDS).shape == (1, 6, 16)
    # Negative control: from the source the conv is taken as called, a unit of its own (what
    # fails sharded; tests/multirank/test_observed_families_fsdp2.py shows it on Bailing-Hybrid).
    assert plan_layout(model, plan).owner[f"{CONV}.weight"] == CONV


@pytest.mark.parametrize(
    "attention", [CallingAttention, KernelCallingAttention, MetadataAttention, InitAttention]
)
def test_a_hand_off_that_calls_or_reads_metadata_is_no_read(attention: type) -> None:
    # Negative controls: the function calls the module (its hooks would gather it), reads only
    # its metadata, or the module is handed on at construction only.
    model = stack(attention)
    assert observed(model).direct_read(model, CONV) is None, attention.__name__
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(model, BF16, plan=plan)
    assert plan_layout(model, plan, observed=observed(model)).owner[f"{CONV}.weight"] == CONV
    if attention is InitAttention:  # `init_conv(self.conv)` in __init__: nothing to name
        assert unseen_uses(model) == []
