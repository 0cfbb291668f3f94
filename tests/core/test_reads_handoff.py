"""A kept module handed to a module-level function that reads its tensors (the source fallback).

Transformers 5.25's Bailing-Hybrid no longer spells ``self.conv1d.weight`` in its attention:
it hands the module to ``causal_conv1d_forward(self.conv1d, ...)``, which reads
``conv1d.weight`` and never calls ``conv1d``. Without ``observed=``, :func:`fp32keep.apply_fsdp2`
judges that from the source (:func:`fp32keep.reads.find_direct_read`); had it taken the module
as called, ``conv1d`` would be a unit of its own that FSDP2 never gathers, and the first forward
fails with ``aten.convolution.default: got mixed torch.Tensor and DTensor`` (seen with 5.25 on 2
gloo ranks). The toys below are that shape, and each negative control one way the same hand-off
is not a read: the function calls the module, reads only metadata, or receives it in ``*args``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from fp32keep import keep_aware_cast, plan_layout, resolve_keep_plan
from fp32keep.reads import find_direct_read
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


def test_module_handed_to_a_reading_function_is_read_not_called() -> None:
    for attention in (HandingAttention, KeywordAttention):
        read = find_direct_read(stack(attention), "layers.0.self_attn.conv")
        assert read is not None, attention.__name__
        assert (read.reader, read.reader_fqn, read.expression) == (
            attention.__name__,
            "layers.0.self_attn",
            "conv.weight",
        )
        assert read.evidence == "read in depthwise_forward(), which it is handed to"


def test_a_function_turned_into_a_module_is_read_through() -> None:
    """Where ``kernels`` is installed, Bailing-Hybrid 5.25's ``causal_conv1d_forward`` is an
    ``nn.Module`` passing its arguments to the function: the scan reads the function (CI saw
    the conv taken as called there, while the same release without ``kernels`` passed)."""
    model = stack(KernelModuleAttention)
    read = find_direct_read(model, "layers.0.self_attn.conv")
    assert read is not None
    assert read.evidence == "read in depthwise_forward(), which it is handed to"
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(model, BF16, plan=plan)
    assert plan_layout(model, plan).owner["layers.0.self_attn.conv.weight"] == "layers.0.self_attn"
    # Negative controls: the wrapped function calls the module (a unit of its own, gathered by
    # its hooks); a wrapper that does not hand its arguments on unchanged is not followed.
    for attention in (KernelCallingAttention, ReorderingAttention):
        other = stack(attention)
        assert find_direct_read(other, "layers.0.self_attn.conv") is None, attention.__name__
        other(torch.arange(6).reshape(1, 6))


def test_the_read_module_goes_with_its_reader_and_the_model_runs() -> None:
    model = stack(HandingAttention)
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(model, BF16, plan=plan)
    layout = plan_layout(model, plan)
    assert layout.owner["layers.0.self_attn.conv.weight"] == "layers.0.self_attn"
    assert all("layers.0.self_attn.conv" not in unit.module_fqns for unit in layout.units)
    assert model(torch.arange(6).reshape(1, 6)).shape == (1, 6, 16)


def test_a_hand_off_that_calls_or_reads_metadata_or_goes_to_star_args_is_no_read() -> None:
    # Negative controls: each the hand-off of the test above, with nothing for the scan to
    # follow to a read (or a read only at construction); the module stays a unit of its own
    # (called, or not known to be read).
    for attention in (CallingAttention, MetadataAttention, StarAttention, InitAttention):
        model = stack(attention)
        assert find_direct_read(model, "layers.0.self_attn.conv") is None, attention.__name__
        model(torch.arange(6).reshape(1, 6))  # each runs unsharded
    plan_model = stack(CallingAttention)
    plan = resolve_keep_plan(plan_model, BF16, transformers_version=SEMANTICS)
    keep_aware_cast(plan_model, BF16, plan=plan)
    layout = plan_layout(plan_model, plan)
    assert layout.owner["layers.0.self_attn.conv.weight"] == "layers.0.self_attn.conv"
