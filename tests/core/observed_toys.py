"""Tiny models whose kept modules are reached in ways a class's own source does not show.

Defined in a file (the source scan reads them). Each has a near twin that must be judged the
other way, for the negative controls.

* :class:`InheritedReadStack`: the encoder's ``forward`` is inherited from a base class and reads
  the kept, frozen ``embed_positions.weight`` without calling it (Voxtral's read, one class up);
  :class:`InheritedCallStack` inherits a ``forward`` that calls it instead.
* :class:`NestedCallsStack`: a kept codec the parent runs through ``encode``, ``quantize`` and
  ``roundtrip`` as well as its ``forward``; ``forward`` calls ``encode``, ``encode`` calls
  ``quantize``, ``roundtrip`` calls the codec itself, and each goes on using the codec's
  parameters after the inner call returns.
* :class:`HelperStack`: a kept codec with a pure helper, ``get_encoded_length`` (arithmetic on
  its convolution's stride, as Kyutai's Mimi codec has), beside ``encode``, which runs it.
* :class:`ChildCalledStack`: calls a kept module and, from outside it, that module's child;
  :class:`ChildNotCalledStack` calls the kept module only.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tests.core.kept_toys import KeptBesideBlock, PositionReader, Tokenizer


class InheritedPositionReader(PositionReader):
    """Defines nothing but its name: its ``forward``, the read, is a base class's."""


class _PositionCaller(PositionReader):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[1], device=x.device)
        x = (x.float() + self.embed_positions(ids)).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return x


class InheritedPositionCaller(_PositionCaller):
    """Defines nothing but its name: its inherited ``forward`` calls ``embed_positions``."""


class InheritedReadStack(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["embed_positions"]
    encoder_class: ClassVar[type[nn.Module]] = InheritedPositionReader

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = self.encoder_class(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


class InheritedCallStack(InheritedReadStack):
    encoder_class = InheritedPositionCaller


class Codec(nn.Module):
    """Kept; computes in FP32 and hands back the stream dtype from every entry point."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.scale.dtype) * self.scale).tanh().to(x.dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.quantize(self.proj(x.to(self.scale.dtype)))  # a gathered method inside one
        return (h * self.scale).to(x.dtype)  # ... and the parameters used after it returns

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        h = self(x)  # the codec's own forward, inside a gathered method
        return self.out(h.to(self.scale.dtype)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)  # a gathered method inside forward
        return self.out(h.to(self.scale.dtype)).to(x.dtype)


class NestedCallsStack(KeptBesideBlock):
    kept_name = "codec"
    kept_class = Codec

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        codes = self.codec.encode(x) + self.codec.quantize(x)
        codes = codes + self.codec(x) + self.codec.roundtrip(x)
        return self.head(self.block(x + codes))


class LengthCodec(nn.Module):
    """Kept; ``encode`` runs its convolution, ``get_encoded_length`` only reads its stride."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel_size=3, stride=2)

    def get_encoded_length(self, length: int) -> int:
        (kernel,), (stride,) = self.conv.kernel_size, self.conv.stride
        return (length - kernel) // stride + 1

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.transpose(1, 2).to(self.conv.weight.dtype))
        return h.transpose(1, 2).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
        return self.encode(x)  # a forward of its own makes the codec a unit, as Mimi's does


class HelperStack(KeptBesideBlock):
    kept_name = "codec"
    kept_class = LengthCodec

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        frames = self.codec.get_encoded_length(x.shape[1])
        codes = self.codec.encode(x)[:, :frames].mean(1, keepdim=True)
        return self.head(self.block(x + codes))


class ChildCalledStack(KeptBesideBlock):
    """Calls the kept ``scaler`` (a tokenizer with a forward of its own; its ``proj`` is a child,
    not a unit) and also, from outside it, the scaler's child ``proj`` (``reach_inside``): FSDP2
    gathers ``proj`` only inside ``scaler``'s call."""

    kept_name = "scaler"
    kept_class = Tokenizer
    reach_inside: ClassVar[bool] = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = self.scaler(x)
        if self.reach_inside:
            h = h + self.scaler.proj(x.to(self.scaler.scale.dtype)).to(x.dtype)
        return self.head(self.block(h))


class ChildNotCalledStack(ChildCalledStack):
    reach_inside = False
