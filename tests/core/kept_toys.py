"""Tiny models with the kept-unit shapes of real families, defined in a file (their source is read).

* :class:`SinkStack`: attention owning only kept ``sinks`` but with Linear children (GptOss-style
  sinks in OpenAI privacy filter; a gate's ``A_log``/``dt_bias``): an owner-with-children unit.
* :class:`RouterStack`: a kept router returning FP32 logits into a bf16 stream (Ernie4_5_Moe):
  what ``output_dtype`` and ``reduce_dtype`` must not touch.
* :class:`ReadStack`: an encoder that reads its kept, frozen ``embed_positions.weight`` without
  calling the module (Voxtral, AudioFlamingo3).
* :class:`ConvReadStack`: a linear attention that hands its kept ``conv.weight`` to a kernel
  without calling ``conv`` (Bailing-Hybrid, Glm5-Next): the reader is an owner unit holding it.
* :class:`EncodeStack`: a kept tokenizer its parent calls through ``encode``, never through
  ``forward`` (Apertus 1.5's vision and audio tokenizers): FSDP2 must gather it around ``encode``.
* :class:`TowerStack`: a fully kept subtree with its own forward and wrap targets inside (Blip2's
  ``qformer`` under fp16): nested kept units.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tests.core.toys import Block, RMSNorm


class SinkAttention(nn.Module):
    """Owns only ``sinks`` (kept) directly; its projections are children that are not kept."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width)
        self.sinks = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Like GptOss: the sink logits join the scores in FP32, the projections stay in the stream.
        scores = self.q_proj(x).float() + self.sinks
        return self.o_proj(scores.softmax(-1).to(x.dtype))


class SinkBlock(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = SinkAttention(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x))


class _BlockStack(nn.Module):
    """Embedding, ``depth`` blocks of :attr:`block`, a head: the shape of a decoder LM."""

    block: ClassVar[type[nn.Module]]

    def __init__(self, width: int = 8, depth: int = 2, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(self.block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class SinkStack(_BlockStack):
    block = SinkBlock
    _no_split_modules: ClassVar[list[str]] = ["SinkBlock"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["sinks"]


class RouterBlock(nn.Module):
    """A kept ``gate`` computes FP32 routing weights from the bf16 stream, as MoE routers do."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.gate = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        weights = self.gate(x.to(self.gate.weight.dtype)).softmax(-1)  # FP32 when gate is kept
        return x + (x.float() * weights).to(x.dtype)


class RouterStack(_BlockStack):
    block = RouterBlock
    _no_split_modules: ClassVar[list[str]] = ["RouterBlock"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["gate"]


class PositionReader(nn.Module):
    """Adds ``embed_positions.weight`` to its input without ever calling ``embed_positions``."""

    def __init__(self, width: int = 8, positions: int = 6, depth: int = 2) -> None:
        super().__init__()
        self.embed_positions = nn.Embedding(positions, width)
        self.embed_positions.requires_grad_(False)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.embed_positions.weight[: x.shape[1]]
        x = (x.float() + positions).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return x


class ReadStack(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["embed_positions"]

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = PositionReader(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


class ConvAttention(nn.Module):
    """Owns no parameter directly; runs a depthwise causal conv from ``conv.weight`` with
    ``F.conv1d`` (as ``causal_conv1d_fn`` does) without ever calling ``conv``."""

    def __init__(self, width: int = 8, kernel: int = 3) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=False)
        self.conv = nn.Conv1d(width, width, kernel, groups=width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.conv.weight
        q = self.q_proj(x).transpose(1, 2).to(weight.dtype)  # FP32 when the conv is kept
        q = nn.functional.conv1d(
            nn.functional.pad(q, (weight.shape[-1] - 1, 0)), weight, None, 1, 0, 1, q.shape[1]
        )
        return self.o_proj(q.transpose(1, 2).to(x.dtype))


class ConvBlock(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = RMSNorm(width)
        self.self_attn = ConvAttention(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(self.norm(x))


class ConvReadStack(_BlockStack):
    block = ConvBlock
    _no_split_modules: ClassVar[list[str]] = ["ConvBlock"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["conv"]


class TowerLayer(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.norm = RMSNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dense(self.norm(x))


class Tower(nn.Module):
    """Fully kept, own forward, computing in FP32 and handing back the stream dtype."""

    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(width, width)
        self.layers = nn.ModuleList(TowerLayer(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x.to(self.proj_in.weight.dtype))
        for layer in self.layers:
            h = layer(h)
        return h.to(x.dtype)


class TowerStack(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block", "TowerLayer"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["tower"]

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.tower = Tower(width)
        self.block = Block(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.tower(self.embed(ids))))


class Tokenizer(nn.Module):
    """Kept; computes in FP32 and hands back the stream dtype. Used through ``encode`` only."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x.to(self.scale.dtype)) * self.scale).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # EncodeStack never calls it
        return self.encode(x)


class KeptBesideBlock(nn.Module):
    """Embedding, one kept module (:attr:`kept_class`, as attribute :attr:`kept_name`, the keep
    list's entry), a block, a head; subclasses say how their forward reaches the kept one."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]
    kept_name: ClassVar[str]
    kept_class: ClassVar[type[nn.Module]]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._keep_in_fp32_modules_strict = [cls.kept_name]

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.add_module(self.kept_name, self.kept_class(width))
        self.block = Block(width)
        self.head = nn.Linear(width, vocab, bias=False)


class EncodeStack(KeptBesideBlock):
    kept_name = "tokenizer"
    kept_class = Tokenizer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.tokenizer.encode(self.embed(ids))))
