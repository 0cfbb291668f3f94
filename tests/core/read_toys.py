"""Tiny models whose code reads a parameter that is not kept, of a unit fp32keep creates, without
calling the module that owns it (issue 23's fail-closed gap). Defined in a file: the layout
reads their source.

* :class:`HeadReadingRoot`: the root owns only a kept ``query_tokens`` (Blip2's shape), so each
  of its children is a unit of its own; it computes its logits from ``self.decoder.head.weight``
  (``F.linear``), a bf16 weight inside the ``decoder`` unit, never calling ``decoder.head``
  (the decoder does not call it either).
* :class:`CalledHeadReadingRoot`: the same, but the decoder calls ``self.head`` too (a tied or
  shared projection), so the source scan's "called somewhere" would not see the root's read.
* :class:`HeadCallingRoot`: the root calls ``self.decoder.head(h)``: a call, but of a module
  that is no unit, inside the ``decoder`` unit, after the decoder ran: it gathers nothing either.
* :class:`ChildCallingRoot`: the positive control: the head is a child of the root (so a unit of
  its own) and the root calls it.
* :class:`SubtreeCallingRoot`: calls ``self.decoder.extra(h)``, a ``Sequential`` inside the
  decoder's unit that owns no parameter itself (its ``Linear`` does).
* :class:`HeadForwardRoot`: as :class:`HeadCallingRoot`, through ``self.decoder.head.forward(h)``
  (an explicit ``.forward``: what counts is the module it runs, the head).
* :class:`ChildForwardRoot`: runs its own child head, a unit, through ``self.head.forward(h)``:
  ``.forward`` skips the module's hooks, FSDP2's all-gather among them, so the head runs sharded.
* :class:`InspectingRoot`: calls its child head, and only inspects a weight inside the decoder's
  unit (``isinstance``, ``.dtype``): what works on a sharded parameter too, so not a use.
* :class:`ProjReadingStack`: an attention owning only kept ``sinks`` (an owner unit, its
  projections units of their own) whose forward reads ``self.o_proj.weight`` without calling it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tests.core.kept_toys import Tower
from tests.core.toys import Block, RMSNorm


class Decoder(nn.Module):
    """Blocks, a norm and a head it never calls (its owner reads the head's weight)."""

    def __init__(self, width: int = 8, vocab: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)  # type: ignore[no-any-return]


class CallingDecoder(Decoder):
    """Also calls its head (on a side output), as a decoder with a shared projection does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + 0 * self.head(x).sum(-1, keepdim=True)


class HeadReadingRoot(nn.Module):
    """Owns only a kept ``query_tokens``; reads ``self.decoder.head.weight`` for its logits."""

    _no_split_modules: ClassVar[list[str]] = ["Block", "TowerLayer"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["query_tokens", "qformer"]
    decoder_class: ClassVar[type[Decoder]] = Decoder

    def __init__(self, width: int = 8, vocab: int = 16, queries: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.query_tokens = nn.Parameter(0.5 * torch.randn(1, queries, width))
        self.qformer = Tower(width)
        self.decoder = self.decoder_class(width, vocab)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed(ids)
        queries = self.qformer(self.query_tokens.expand(ids.shape[0], -1, -1))
        return self.decoder(torch.cat([queries.to(embeds.dtype), embeds], dim=1))  # type: ignore[no-any-return]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.hidden(ids)
        return nn.functional.linear(h, self.decoder.head.weight)


class CalledHeadReadingRoot(HeadReadingRoot):
    decoder_class = CallingDecoder


class HeadCallingRoot(HeadReadingRoot):
    """Calls the head inside the decoder's unit from the root."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.head(self.hidden(ids))  # type: ignore[no-any-return]


class ChildCallingRoot(HeadReadingRoot):
    """The head is the root's child, and the root calls it."""

    def __init__(self, width: int = 8, vocab: int = 16, queries: int = 2) -> None:
        super().__init__(width, vocab, queries)
        del self.decoder.head
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))  # type: ignore[no-any-return]


class SubtreeCallingRoot(ChildCallingRoot):
    """Calls a container inside the decoder's unit from the root."""

    def __init__(self, width: int = 8, vocab: int = 16, queries: int = 2) -> None:
        super().__init__(width, vocab, queries)
        self.decoder.extra = nn.Sequential(nn.Linear(width, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder.extra(self.hidden(ids)))  # type: ignore[no-any-return]


class HeadForwardRoot(HeadReadingRoot):
    """Runs the head inside the decoder's unit from the root through ``.forward(...)``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.head.forward(self.hidden(ids))  # type: ignore[no-any-return]


class ChildForwardRoot(ChildCallingRoot):
    """Runs its child head, a unit of its own, through ``.forward(...)``: not a call, as FSDP2
    sees it (its hooks run in ``__call__``), so the head is never all-gathered."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.forward(self.hidden(ids))  # type: ignore[no-any-return]


class InspectingRoot(ChildCallingRoot):
    """Looks at ``decoder.norm.weight`` without computing with it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.hidden(ids))
        if not isinstance(self.decoder.norm.weight, torch.Tensor):  # pragma: no cover
            raise TypeError("a tensor")
        return logits.to(self.decoder.norm.weight.dtype)  # type: ignore[no-any-return]


class ProjReadingAttention(nn.Module):
    """Owns only kept ``sinks``; reads its ``o_proj``'s weight instead of calling it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.sinks = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q_proj(x).float() + self.sinks
        return nn.functional.linear(scores.softmax(-1).to(x.dtype), self.o_proj.weight)


class ProjReadingBlock(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = ProjReadingAttention(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x))  # type: ignore[no-any-return]


class ProjReadingStack(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["ProjReadingBlock"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["sinks"]

    def __init__(self, width: int = 8, depth: int = 2, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(ProjReadingBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]
